"""What the Python API says to a caller who passes the wrong kind of thing: one error naming the
argument and the fix, never an error from deep inside torch or a library."""

import pytest
import torch

from farsight.errors import InputError, InputTypeError, ModelFileError
from farsight.models import (
    DRTConfig,
    DRTForCausalLM,
    TransformerConfig,
    TransformerForCausalLM,
    build_model,
    export_model,
    load_model,
)

SMALL = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
DRT = {**SMALL, "chunk_size": 8, "window": 16, "top_k": 2, "encoder_layers": 1}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "drt"
    DRTForCausalLM(DRTConfig(**DRT)).save_pretrained(path)
    return path


def test_a_model_is_built_from_its_own_config_class():
    with pytest.raises(InputTypeError, match=r"DRTForCausalLM is built from a DRTConfig, got a dict; pass DRTConfig"):
        DRTForCausalLM({"d_model": 32})
    with pytest.raises(
        InputTypeError, match="TransformerForCausalLM is built from a TransformerConfig, got a DRTConfig"
    ):
        TransformerForCausalLM(DRTConfig(**DRT))
    with pytest.raises(InputTypeError, match=r"build_model takes a model section, a mapping with a 'type' key"):
        build_model("drt")


def test_a_model_is_named_by_a_path_on_a_device_this_machine_has(saved, tmp_path):
    for wrong in (3, None):
        with pytest.raises(InputTypeError, match="a model is named by its directory's path"):
            load_model(wrong)
    with pytest.raises(InputError, match=r"map_location='gpu' is not a device; use 'cpu', 'cuda'"):
        load_model(saved, map_location="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="map_location='cuda' but this machine has no CUDA GPU"):
            load_model(saved, map_location="cuda")
    with pytest.raises(InputError, match=r"dtype='bfloat16' is not one of fp32, bf16, fp16"):
        export_model(saved, tmp_path / "out", dtype="bfloat16")
    with pytest.raises(InputError, match="is not one of fp32, bf16, fp16"):
        export_model(saved, tmp_path / "out", dtype=torch.bfloat16)
    with pytest.raises(InputTypeError, match="readme must be the card's text or a function of the model, got int"):
        export_model(saved, tmp_path / "out", readme=5)
    assert not (tmp_path / "out").exists()


def test_weights_of_other_shapes_name_the_first_tensor_that_differs(saved):
    wider = DRTForCausalLM(DRTConfig(**{**DRT, "vocab_size": 300}))
    with pytest.raises(ModelFileError) as refused:
        from farsight.models.io import load_weights

        load_weights(wider, saved)
    message = str(refused.value)
    assert "holds tensors of other shapes than this model (embed.weight is [260, 32] there, [300, 32] here" in message
    assert "\n" not in message and "size mismatch" not in message


@pytest.mark.parametrize("precision", ["fp32", "autocast-bf16", "bf16"])
@pytest.mark.parametrize("kind", ["drt", "transformer"])
def test_labels_are_token_ids_of_the_vocabulary_or_minus_100(kind, precision):
    import contextlib

    model = DRTForCausalLM(DRTConfig(**DRT)) if kind == "drt" else TransformerForCausalLM(TransformerConfig(**SMALL))
    model = model.to(torch.bfloat16) if precision == "bf16" else model
    context = torch.autocast("cpu", torch.bfloat16) if precision == "autocast-bf16" else contextlib.nullcontext()
    ids = torch.randint(0, 200, (2, 24))
    with context:
        with pytest.raises(InputError, match=r"label 1\d{3} is outside the model's vocabulary \[0, 260\)"):
            model(ids, labels=ids + 1000)
        with pytest.raises(InputTypeError, match="labels must be an integer torch.Tensor"):
            model(ids, labels=ids.float())
        with pytest.raises(InputTypeError, match="input_ids must be an integer torch.Tensor"):
            model(ids.tolist())
        with pytest.raises(InputTypeError, match="input_ids must be an integer torch.Tensor"):
            model.generate(ids.tolist(), max_new_tokens=1)
        ignored = ids.clone()
        ignored[:, :5] = -100
        assert torch.isfinite(model(ids, labels=ignored).loss)


def test_sampling_settings_must_be_numbers():
    model = TransformerForCausalLM(TransformerConfig(**SMALL))
    ids = torch.randint(0, 200, (1, 8))
    with pytest.raises(InputError, match="temperature must be a number, got '0'"):
        model.generate(ids, max_new_tokens=2, temperature="0")
    with pytest.raises(InputError, match="top_k must be a whole number, got 2.5"):
        model.generate(ids, max_new_tokens=2, top_k=2.5)
    with pytest.raises(InputError, match="temperature must be a finite number >= 0"):
        model.generate(ids, max_new_tokens=2, temperature=float("nan"))


def test_an_unknown_field_in_config_json_names_the_file(saved, tmp_path):
    import json
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    (edited / "checksums.json").unlink()  # as an older farsight wrote it: nothing to verify against
    meta = json.loads((edited / "config.json").read_text())
    meta["config"]["dmodel"] = meta["config"].pop("d_model")
    (edited / "config.json").write_text(json.dumps(meta))
    with pytest.raises(
        ModelFileError, match=r"edited/config.json: unknown config field 'config.dmodel' .*did you mean"
    ):
        load_model(edited)


def test_sampling_at_a_tiny_temperature_is_greedy_and_bad_logits_are_named():
    from farsight.models import sample_next_token

    logits = torch.randn(3, 50) * 10
    assert torch.equal(sample_next_token(logits, temperature=1e-45), logits.argmax(-1))
    half = logits.to(torch.bfloat16)  # what a bf16 model's head gives
    assert torch.equal(sample_next_token(half, temperature=1e-45), half.argmax(-1))
    logits[1] = float("nan")
    with pytest.raises(InputError, match="logits are NaN or all -inf"):
        sample_next_token(logits, temperature=0.8)


def test_session_inputs_are_tensors_and_padding_goes_with_the_first_prefill():
    model = DRTForCausalLM(DRTConfig(**DRT)).eval()
    ids = torch.randint(0, 200, (1, 20))
    with model.new_session(1) as session:
        with pytest.raises(InputTypeError, match="prefill takes token ids as a .* tensor .*, got a int"):
            session.prefill(5)
        with pytest.raises(InputTypeError, match="prefill's blocks are tensors of token ids, got a list"):
            session.prefill([[1, 2, 3]])
        with pytest.raises(InputError, match=r"length=5 goes with an iterable of blocks"):
            session.prefill(ids, length=5)
    with model.new_session(1) as session:
        session.prefill(ids)
        padded = torch.ones_like(ids)
        padded[:, :4] = 0
        with pytest.raises(InputError, match="attention_mask with zeros .* goes with a session's first prefill"):
            session.prefill(ids, attention_mask=padded)
        with pytest.raises(InputTypeError, match="step takes a tensor of one token id per row, got a int"):
            session.step(5)


def test_generate_checks_its_session_lengths_and_token_ids():
    import numpy as np

    from farsight.models import generate

    model = DRTForCausalLM(DRTConfig(**DRT)).eval()
    ids = torch.randint(0, 200, (1, 20))
    with pytest.raises(InputTypeError, match="generate decodes in a Session, got a DRTForCausalLM"):
        generate(model, ids, 3)
    for bad in (None, "5", 2.5, True):
        with pytest.raises(InputError, match="max_new_tokens must be a whole number >= 0"):
            model.generate(ids, max_new_tokens=bad)
    with pytest.raises(
        InputError, match=r"eos_token_id holds 9999, not a token id of the model's vocabulary \[0, 260\)"
    ):
        model.generate(ids, max_new_tokens=2, eos_token_id=9999)
    with model.new_session(1) as session, pytest.raises(InputError, match="pad_token_id holds -1"):
        generate(session, ids, 2, eos_token_id=3, pad_token_id=-1)
    with (
        model.new_session(1) as session,
        pytest.raises(InputTypeError, match="input_ids must be a tensor of token ids, got a list"),
    ):
        generate(session, ids.tolist(), 2)
    out = model.generate(ids, max_new_tokens=2, eos_token_id=np.int64(258), temperature=0)  # numpy ids are ids
    assert out.shape == (1, 22)
