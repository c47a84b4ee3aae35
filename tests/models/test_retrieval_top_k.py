"""Reading another number of past chunks than a DRT was trained with (`set_retrieval_top_k`), from
Python, the commands and their records; what the commands and cards do with either reading option
(top-k, and the neighbors of tests/models/test_retrieval_neighbors.py)."""

from __future__ import annotations

import json

import pytest
import torch

from farsight.cli import main
from farsight.data.tokenizers import ByteTokenizer
from farsight.errors import InputError
from farsight.models import (
    DRTConfig,
    DRTForCausalLM,
    TransformerConfig,
    TransformerForCausalLM,
    load_model,
    set_retrieval_neighbors,
    set_retrieval_top_k,
)

SIZES = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}


def tiny_drt(top_k: int, **reading: int) -> DRTForCausalLM:
    torch.manual_seed(0)
    config = DRTConfig(
        **SIZES, chunk_size=8, window=16, top_k=top_k, encoder_layers=1, landmark_id=259, pad_id=256, **reading
    )
    return DRTForCausalLM(config).eval()


@pytest.fixture(scope="module")
def drt_dir(tmp_path_factory):
    return tiny_drt(3).save_pretrained(tmp_path_factory.mktemp("drt") / "model", tokenizer=ByteTokenizer())


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = TransformerForCausalLM(TransformerConfig(**SIZES))
    return model.save_pretrained(tmp_path_factory.mktemp("transformer") / "model", tokenizer=ByteTokenizer())


@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_a_drt_set_to_k_chunks_computes_what_one_built_with_k_does(top_k):
    model, built = tiny_drt(3), tiny_drt(top_k)
    assert set_retrieval_top_k(model, top_k) == 3
    ids = torch.randint(0, 256, (2, 75))  # 9 chunks and a part: up to 8 past chunks to choose from
    out = model(ids, return_retrieval=True)
    expected = built(ids, return_retrieval=True)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)
    for indices in out.retrieval.indices:
        assert indices.shape[-1] == top_k
        assert (indices[:, -1] >= 0).sum() == 2 * min(top_k, 8)  # the last chunk's K choices, all real
    if top_k != 3:  # the number read changes what the model computes
        assert not torch.equal(out.logits, tiny_drt(3)(ids).logits)


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize(
    ("told", "built_with"),
    [
        (lambda model: set_retrieval_top_k(model, 1), {"top_k": 1}),
        (lambda model: set_retrieval_neighbors(model, 1), {"top_k": 3, "neighbors_before": 1, "neighbors_after": 1}),
    ],
    ids=["top-k", "neighbors"],
)
def test_a_reading_set_in_bf16_or_under_autocast_computes_what_a_model_built_with_it_does(precision, told, built_with):
    model, built = tiny_drt(3), tiny_drt(**built_with)
    if precision == "bf16":
        model, built = model.to(torch.bfloat16), built.to(torch.bfloat16)
    told(model)
    ids = torch.randint(0, 256, (2, 75))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        torch.testing.assert_close(model(ids).logits, built(ids).logits, rtol=0, atol=0)


def test_a_session_reads_the_new_number_of_chunks():
    model = tiny_drt(3)
    ids = torch.randint(0, 256, (1, 60))
    set_retrieval_top_k(model, 1)
    streamed = model.new_session().prefill(ids)
    torch.testing.assert_close(streamed, tiny_drt(1).new_session().prefill(ids), rtol=0, atol=0)
    assert not torch.allclose(streamed, tiny_drt(3).new_session().prefill(ids), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_a_number_of_chunks_that_is_not_a_whole_number_from_1_is_refused(value):
    with pytest.raises(InputError, match="retrieval top-k must be a whole number >= 1"):
        set_retrieval_top_k(tiny_drt(3), value)


@pytest.mark.parametrize(
    ("setter", "value", "option"),
    [(set_retrieval_top_k, 2, "retrieval top-k"), (set_retrieval_neighbors, 1, "retrieval neighbors")],
)
def test_a_model_without_retrieval_is_refused_by_name(setter, value, option):
    with pytest.raises(
        InputError, match=f"{option} applies to models with causal retrieval.*'transformer' model; drop"
    ):
        setter(TransformerForCausalLM(TransformerConfig(**SIZES)), value)


@pytest.mark.parametrize(
    ("option", "field", "recorded"),
    [
        (["--retrieval-top-k", "1"], "retrieval_top_k", 1),
        (["--retrieval-neighbors", "0:1"], "retrieval_neighbors", [0, 1]),
    ],
)
def test_the_commands_read_as_told_and_record_it(drt_dir, tmp_path, option, field, recorded):
    base = ["eval", "passkey", "--model", str(drt_dir), "--filler", "repeat", "--lengths", "96", "--depths", "0.5"]
    default, told = tmp_path / "default.json", tmp_path / "told.json"
    assert main([*base, "--trials", "1", "--out", str(default)]) == 0
    assert main([*base, "--trials", "1", *option, "--out", str(told)]) == 0
    assert field not in json.loads(default.read_text())
    assert json.loads(told.read_text())[field] == recorded
    config = load_model(drt_dir).config  # the model directory is left as it was
    assert (config.top_k, config.neighbors_before, config.neighbors_after) == (3, 0, 0)


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--retrieval-top-k", "2"], "reading the 2 best past chunks per chunk (`--retrieval-top-k 2`)"),
        (
            ["--retrieval-neighbors", "1"],
            "each with the 1 chunk(s) before and 1 after it (`--retrieval-neighbors 1:1`)",
        ),
    ],
)
def test_the_model_card_says_how_a_result_read(drt_dir, tmp_path, option, said):
    from farsight.eval.card import ModelNames, results_section
    from farsight.models.io import trained_weights

    measured = tmp_path / "read.json"
    passkey = ["eval", "passkey", "--model", str(drt_dir), "--filler", "repeat", "--lengths", "96"]
    assert main([*passkey, "--depths", "0.5", "--trials", "1", *option, "--out", str(measured)]) == 0
    names = ModelNames({drt_dir.resolve(): "tiny"}, {trained_weights(drt_dir): "tiny"})
    assert said in "\n".join(results_section(measured, names))


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "passkey", "--filler", "repeat", "--lengths", "96", "--depths", "0.5"],
        ["generate", "--prompt", "a", "--max-new-tokens", "1"],
    ],
)
def test_a_command_refuses_k_for_a_model_without_retrieval_in_one_line(argv, transformer_dir, capsys):
    assert main([*argv, "--model", str(transformer_dir), "--retrieval-top-k", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'transformer' model; drop the option" in err
