"""What a transformers user expects of a causal LM, on farsight's: generate's defaults, left padding
from the tokenizer, dtype="auto", resize_token_embeddings, forward's standard keywords (and one-line
refusals of the rest), right-padded training batches, and the usual methods."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import farsight.hf  # noqa: F401  (registers the Auto classes)
from farsight.data.tokenizers import ByteTokenizer
from farsight.errors import InputError
from farsight.models import TransformerConfig, TransformerForCausalLM, causal_lm_loss, load_model

TEXTS = ["The passkey is 48213.", "Remember it: the passkey is 48213. The passkey is"]


def one_line(error):
    assert "\n" not in str(error.value)


def test_generate_without_a_length_writes_transformers_default_20_tokens(castle_dir):
    model = AutoModelForCausalLM.from_pretrained(castle_dir)
    ids = AutoTokenizer.from_pretrained(castle_dir)(TEXTS[:1], return_tensors="pt")["input_ids"]
    out = model.generate(ids, eos_token_id=None)
    assert out.shape == (1, ids.shape[1] + 20)
    assert torch.equal(out, model.generate(ids, max_new_tokens=20, eos_token_id=None))


@pytest.mark.parametrize("kind", ["drt", "castle"])
def test_the_tokenizer_pads_on_the_left_so_a_padded_batch_generates(kind, tiny_drt_dir, castle_dir):
    directory = tiny_drt_dir if kind == "drt" else castle_dir
    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert tokenizer.padding_side == "left"
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4)
    for row, text in enumerate(TEXTS):
        alone = model.generate(tokenizer([text], return_tensors="pt")["input_ids"], max_new_tokens=4)
        assert torch.equal(out[row, -4:], alone[0, -4:])
    tokenizer.padding_side = "right"
    with pytest.raises(InputError, match=r"pad on the left \(tokenizer.padding_side = 'left'\)") as error:
        model.generate(**tokenizer(TEXTS, padding=True, return_tensors="pt"), max_new_tokens=4)
    one_line(error)


def test_dtype_auto_loads_the_dtype_config_json_records(drt_dir, tiny_drt_dir, tmp_path):
    assert AutoModelForCausalLM.from_pretrained(drt_dir, dtype="auto").dtype == torch.bfloat16  # shipped in bf16
    assert AutoModelForCausalLM.from_pretrained(drt_dir, torch_dtype="auto").dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(drt_dir).dtype == torch.float32  # unset: fp32, as before
    assert AutoModelForCausalLM.from_pretrained(tiny_drt_dir, dtype="auto").dtype == torch.float32  # saved in fp32
    # a bf16 model saved through the HF API records bf16, and "auto" loads it so
    AutoModelForCausalLM.from_pretrained(tiny_drt_dir, dtype="bf16").save_pretrained(tmp_path / "bf16")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16


@pytest.mark.parametrize("tied", [True, False])
def test_resize_token_embeddings_keeps_the_old_rows_and_saves(tied, tmp_path):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=260, d_model=16, n_layers=1, n_heads=2, tie_embeddings=tied)
    directory = TransformerForCausalLM(config).save_pretrained(tmp_path / "model", tokenizer=ByteTokenizer())
    model = AutoModelForCausalLM.from_pretrained(directory)
    embed, head = model.get_input_embeddings().weight.clone(), model.get_output_embeddings().weight.clone()
    resized = model.resize_token_embeddings(270, pad_to_multiple_of=16)  # 270 -> 272
    assert resized is model.get_input_embeddings() and resized.weight.shape == (272, 16)
    assert model.config.vocab_size == model.model.config.vocab_size == 272
    assert torch.equal(resized.weight[:260], embed)
    assert torch.allclose(resized.weight[260:], embed.mean(0).expand(12, -1))  # new rows: the mean
    assert (model.get_output_embeddings().weight is resized.weight) == tied
    assert torch.equal(model.get_output_embeddings().weight[:260], head)
    assert model(torch.tensor([[1, 271]])).logits.shape == (1, 2, 272)
    model.save_pretrained(tmp_path / "resized")
    assert load_model(tmp_path / "resized").config.vocab_size == 272
    with pytest.raises(InputError, match=r"would drop ids the model or its tokenizer uses \(up to 259\)") as error:
        model.resize_token_embeddings(100)
    one_line(error)


def test_forward_takes_the_standard_keywords(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_drt_dir)
    ids = tokenizer(TEXTS[1:], return_tensors="pt")["input_ids"]
    plain = model(ids, labels=ids)
    width = ids.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(width)[None],
        cache_position=torch.arange(width),
        labels=ids,
        use_cache=False,
        output_attentions=False,
        output_hidden_states=False,
        return_dict=True,
    )
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.loss, plain.loss)
    assert out.past_key_values is None
    loss, logits = model(ids, labels=ids, return_dict=False)
    assert torch.equal(loss, plain.loss) and torch.equal(logits, plain.logits)
    assert torch.equal(model(ids, logits_to_keep=1).logits, plain.logits[:, -1:])
    assert torch.equal(model(ids, logits_to_keep=torch.tensor([0, 2])).logits, plain.logits[:, [0, 2]])
    # Trainer's num_items_in_batch: the summed loss over the batch's target count
    summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(100)).loss
    assert torch.allclose(summed, plain.loss * (width - 1) / 100)
    # left padding with the position_ids transformers derives from the mask
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    positions = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    assert torch.equal(model(**batch, position_ids=positions).logits, model(**batch).logits)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"output_hidden_states": True}, "output_hidden_states=True is not supported"),
        ({"output_attentions": True}, "output_attentions=True is not supported"),
        ({"position_ids": torch.tensor([[0, 1, 3, 4, 5, 6]])}, "position_ids must count each row's tokens from 0"),
        ({"position_ids": torch.tensor([[2, 3, 4, 5, 6, 7]])}, "or restart at 0 where a packed sequence begins"),
        ({"cache_position": torch.arange(3, 9)}, "cache_position must be 0..5"),
        ({"token_type_ids": torch.zeros(1, 6)}, r"arguments farsight does not take: \['token_type_ids'\]"),
        ({"inputs_embeds": torch.zeros(1, 6, 32)}, "inputs_embeds is not supported: a farsight model embeds"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_forward_refuses_what_it_does_not_implement_in_one_line(kwargs, message, tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    with pytest.raises(InputError, match=message) as error:
        model(torch.tensor([[65, 66, 67, 68, 69, 70]]), **kwargs)
    one_line(error)


@pytest.mark.parametrize("kind", ["drt", "castle"])
def test_a_right_padded_batch_trains_on_its_tokens_exactly(kind, tiny_drt_dir, castle_dir):
    """TRL and Trainer pad on the right, labels -100 there, use_cache=False: the logits and loss
    of the real tokens are those of each row alone (in eval mode: a training DRT's retrieval
    samples), and the gradient flows."""
    directory = tiny_drt_dir if kind == "drt" else castle_dir
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="right")
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(**batch, labels=labels, use_cache=False)
    rows = [tokenizer([text], return_tensors="pt")["input_ids"] for text in TEXTS]
    alone = [model(row).logits[0] for row in rows]
    short = rows[0].shape[1]
    assert torch.allclose(out.logits[0, :short], alone[0], atol=1e-5, rtol=0)
    assert torch.equal(out.logits[0, short:], torch.zeros_like(out.logits[0, short:]))
    assert torch.allclose(out.logits[1], alone[1], atol=1e-5, rtol=0)
    one_row = model(batch["input_ids"][0], attention_mask=batch["attention_mask"][0]).logits  # ids and mask [T]
    assert torch.allclose(one_row[0], out.logits[0], atol=1e-5, rtol=0)
    targets = sum(row.shape[1] - 1 for row in rows)
    by_rows = sum(causal_lm_loss(a[None], r) * (r.shape[1] - 1) for a, r in zip(alone, rows)) / targets
    assert torch.allclose(out.loss, by_rows, atol=1e-5)
    # labels left at the pads' ids are not targets either
    assert torch.allclose(model(**batch, labels=batch["input_ids"]).loss, by_rows, atol=1e-5)
    model.train()
    model(**batch, labels=labels, use_cache=False).loss.backward()
    assert model.get_input_embeddings().weight.grad is not None


def test_the_usual_causal_lm_methods(tiny_drt_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    native = load_model(tiny_drt_dir)
    assert model.num_parameters() == native.num_parameters()
    assert model.get_output_embeddings() is model.model.lm_head and model.can_generate()
    assert model.generation_config.eos_token_id == ByteTokenizer().eos_id
    batch = AutoTokenizer.from_pretrained(tiny_drt_dir)(TEXTS, padding=True, return_tensors="pt")
    step = model.prepare_inputs_for_generation(**batch, use_cache=True, cache_position=torch.arange(3))
    assert torch.equal(model(**step).logits, model(**batch).logits)
    assert model.to(torch.bfloat16).dtype == torch.bfloat16
    assert model(batch["input_ids"][1:]).logits.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype="auto")
    assert again.dtype == torch.bfloat16 and type(again) is type(model)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_an_attention_mask_of_another_shape_is_refused_even_when_all_ones(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    ids = torch.randint(0, 200, (1, 9))
    for mask in (torch.ones(1, 3), torch.ones(2, 9)):
        with pytest.raises(InputError, match="attention_mask"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(InputError, match="attention_mask must be a tensor of the ids' shape"):
            model(ids, attention_mask=mask)
    assert model.generate(ids, attention_mask=torch.ones(1, 9), max_new_tokens=2).shape == (1, 11)


def test_chunk_memory_options_on_a_transformer_are_refused_when_loading(castle_dir):
    with pytest.raises(ValueError, match="choose where a DRT keeps its chunk memory; .* leave them unset"):
        AutoModelForCausalLM.from_pretrained(castle_dir, memory="disk")
