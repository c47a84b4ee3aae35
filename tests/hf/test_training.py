"""Training farsight models through transformers and TRL: the activation-checkpointing hook,
the model body TRL's SFTTrainer scores through the LM head, and a fine-tune that learns to stop."""

import importlib.util
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from farsight.errors import InputError
from farsight.hf import FarsightForCausalLM


def blocks(model: FarsightForCausalLM) -> list[torch.nn.Module]:
    native = model.model
    return [*native.lower, *native.encoder, *native.upper] if native.model_type == "drt" else list(native.blocks)


@pytest.mark.parametrize("fixture", ["tiny_drt_dir", "castle_dir"])
def test_gradient_checkpointing_enable_recomputes_every_block_with_the_same_gradients(fixture, request):
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).train()
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the DRT's Gumbel noise
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = grads()
    calls = []
    for block in blocks(model):
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert model.is_gradient_checkpointing and model.model.activation_checkpointing
        checkpointed = grads()
        assert len(calls) == 2 * len(blocks(model))  # forward, then recomputed in the backward
        for name, grad in checkpointed.items():
            torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=name)
        model.gradient_checkpointing_disable()
        assert not model.is_gradient_checkpointing and not model.model.activation_checkpointing
        with pytest.raises(InputError, match="use_reentrant"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not model.model.activation_checkpointing


def test_the_model_body_gives_the_hidden_states_the_lm_head_reads(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding, as TRL's collator pads
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    logits = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(model.get_output_embeddings()(hidden), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="inputs_embeds"):
        model.base_model(input_ids=ids, inputs_embeds=torch.zeros(2, 21, 32))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install farsight[hf])")
@pytest.mark.parametrize("fixture", ["tiny_drt_dir", "castle_dir"])
def test_trl_sft_fine_tunes_a_model_that_stops_at_its_eos(fixture, request, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    source = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eos, prompt, answer = tokenizer.eos_token_id, tokenizer.encode("2+2="), tokenizer.encode(" four")
    expected = [*prompt, *answer, eos]
    before = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert before[0].tolist() != expected  # the untrained model neither answers nor stops
    # one short example repeated: TRL appends "<|eos|>" to each completion, as text
    data = Dataset.from_dict({"prompt": ["2+2="] * 8, "completion": [" four"] * 8})
    # SFTConfig's defaults (gradient checkpointing, bf16 autocast, completion-only loss), with a
    # learning rate for a tiny model and a few steps (about 1 s on 2 idle cores)
    args = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=30,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # bf16, the default, needs it on a CPU-only machine
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    example = trainer.train_dataset[0]
    assert example["input_ids"] == expected  # the text "<|eos|>" is the eos id, not 7 bytes
    assert example["labels"] == [-100] * len(prompt) + [*answer, eos]
    trainer.train()
    assert model.model.activation_checkpointing  # SFTConfig's gradient_checkpointing=True reached the blocks
    trainer.save_model(str(tmp_path / "tuned"))

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert tuned.generation_config.eos_token_id == eos
    out = tuned.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert out[0].tolist() == expected  # it answers, ends at its eos, and generation stops there
    assert AutoTokenizer.from_pretrained(tmp_path / "tuned").decode(out[0], skip_special_tokens=True) == "2+2= four"
