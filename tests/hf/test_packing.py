"""Padding-free training through transformers and TRL: a row of several sequences whose
position_ids restart at 0 (DataCollatorWithFlattening, SFTTrainer(padding_free=True)) computes
what each sequence computes in a row of its own, the loss farsight's own packed forward gives."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening

import farsight.hf  # noqa: F401  (registers farsight's classes with the Auto* factories)
from farsight.errors import InputError
from farsight.ops.documents import document_ids_from_positions

TEXTS = ["The passkey is 48213.", "x", "Remember it: the passkey is 48213. The passkey is", "def f(a):\n    return a"]


def flattened(tokenizer, **options):
    return DataCollatorWithFlattening(**options)([{"input_ids": tokenizer.encode(text)} for text in TEXTS])


@pytest.mark.parametrize("fixture", ["tiny_drt_dir", "castle_dir"])
def test_a_flattened_batch_computes_each_sequence_as_if_alone(fixture, request):
    directory = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(directory).double().eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = flattened(tokenizer)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    out = model(**batch)
    # farsight's own packed forward: the same loss
    documents = document_ids_from_positions(batch["position_ids"])
    native = model.model(batch["input_ids"], labels=batch["input_ids"], document_ids=documents)
    torch.testing.assert_close(out.loss, native.loss, rtol=1e-12, atol=1e-12)
    # each sequence alone: its logits, and the loss as the mean over all their predictions
    start, total, count = 0, 0.0, 0
    for text in TEXTS:
        ids = torch.tensor([tokenizer.encode(text)])
        alone = model(ids, labels=ids)
        n = ids.shape[1]
        torch.testing.assert_close(out.logits[0, start : start + n], alone.logits[0], rtol=1e-10, atol=1e-10)
        total, count, start = total + alone.loss * (n - 1), count + n - 1, start + n
    torch.testing.assert_close(out.loss, total / count, rtol=1e-10, atol=1e-10)
    # the varlen boundaries a collator may add describe the same sequences
    full = flattened(tokenizer, return_flash_attn_kwargs=True, return_seq_idx=True)
    torch.testing.assert_close(model(**full).loss, out.loss, rtol=0, atol=0)
    hidden = model.base_model(**{k: v for k, v in full.items() if k != "labels"}).last_hidden_state
    torch.testing.assert_close(model.get_output_embeddings()(hidden), out.logits, rtol=1e-10, atol=1e-10)


def test_boundaries_that_disagree_with_the_positions_are_refused_in_one_line(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_drt_dir)
    batch = flattened(tokenizer, return_flash_attn_kwargs=True)
    batch["cu_seq_lens_q"] = torch.tensor([0, 3, batch["input_ids"].shape[1]], dtype=torch.int32)
    with pytest.raises(InputError, match="cu_seq_lens_q and position_ids describe different packed sequences") as e:
        model(**batch)
    assert "\n" not in str(e.value)
    batch = flattened(tokenizer)
    with pytest.raises(InputError, match="restart at 0 where a packed sequence begins in a row without padding"):
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"]).index_fill_(1, torch.tensor([0]), 0))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install farsight[hf])")
@pytest.mark.parametrize("fixture", ["tiny_drt_dir", "castle_dir"])
def test_trl_padding_free_fine_tunes_on_packed_rows(fixture, request, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    source = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eos, prompt, answer = tokenizer.eos_token_id, tokenizer.encode("2+2="), tokenizer.encode(" four")
    seen, run = [], model._run

    def recording(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append(out[3])  # the document ids the positions gave
        return out

    model._run = recording  # forward and the body TRL scores through both run it
    data = Dataset.from_dict({"prompt": ["2+2="] * 16, "completion": [" four"] * 16})
    args = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=30,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        padding_free=True,
        max_length=None,  # TRL refuses a max_length it would not enforce without its own packing
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
    # four examples a row, each its own document
    assert seen and all(ids is not None and ids.shape[0] == 1 and int(ids.max()) == 3 for ids in seen)
    model._run = run
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert out[0].tolist() == [*prompt, *answer, eos]
