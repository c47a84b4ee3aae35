"""Reading the chunks beside each retrieved one (`set_retrieval_neighbors`, docs/design.md §2.8),
from Python and the commands (bf16 and autocast, the records and the cards' note:
tests/models/test_retrieval_top_k.py)."""

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
    parse_neighbors,
    set_retrieval_neighbors,
)

SIZES = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}


def tiny_drt(before: int = 0, after: int = 0, top_k: int = 1) -> DRTForCausalLM:
    torch.manual_seed(0)
    config = DRTConfig(
        **SIZES,
        chunk_size=8,
        window=16,
        top_k=top_k,
        encoder_layers=1,
        landmark_id=259,
        pad_id=256,
        neighbors_before=before,
        neighbors_after=after,
    )
    return DRTForCausalLM(config).eval()


@pytest.fixture(scope="module")
def drt_dir(tmp_path_factory):
    return tiny_drt().save_pretrained(tmp_path_factory.mktemp("drt") / "model", tokenizer=ByteTokenizer())


@pytest.mark.parametrize(("value", "parsed"), [(1, (1, 1)), ("2", (2, 2)), ("1:0", (1, 0)), ((0, 3), (0, 3))])
def test_neighbors_are_n_on_each_side_or_before_and_after(value, parsed):
    assert parse_neighbors(value) == parsed


@pytest.mark.parametrize("value", [-1, 1.5, True, "a", "1:2:3", "1:-1", "", None, (1, 2, 3)])
def test_malformed_neighbors_are_refused_naming_the_forms(value):
    with pytest.raises(InputError, match=r"must be N \(N chunks on each side\) or BEFORE:AFTER"):
        parse_neighbors(value)


@pytest.mark.parametrize(("before", "after"), [(1, 0), (0, 1), (1, 1), (2, 3)])
def test_a_drt_set_to_read_neighbors_computes_what_one_built_with_them_does(before, after):
    model, built = tiny_drt(), tiny_drt(before, after)
    assert set_retrieval_neighbors(model, (before, after)) == (0, 0)
    ids = torch.randint(0, 256, (2, 75))  # 9 chunks and a part
    out = model(ids, return_retrieval=True)
    torch.testing.assert_close(out.logits, built(ids).logits, rtol=0, atol=0)
    last = out.retrieval.indices[0][:, -1]  # [B, 1 + before + after]: chunk 8's retrieval, chunks 0-7 to read
    assert last.shape[-1] == 1 + before + after
    for row in last.tolist():
        read = [c for c in row if c >= 0]
        assert len(read) == len(set(read)) and all(0 <= c < 8 for c in read)
        assert read[1:] == [
            c for c in (read[0] + o for o in [*range(-1, -before - 1, -1), *range(1, after + 1)]) if 0 <= c < 8
        ]
    # reading more chunks changes what the model computes
    assert not torch.equal(out.logits, tiny_drt()(ids).logits)


def test_the_loss_reaches_the_retriever_through_the_neighbors_weights():
    # two chunks retrieved (one alone always weighs 1); the neighbors' share of the gradient shows
    # as a difference from the same model reading no neighbors
    grads = []
    for before, after in ((0, 0), (0, 2)):
        model = tiny_drt(before, after, top_k=2).double()
        ids = torch.randint(0, 256, (2, 75), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).loss.backward()
        grads.append(model.landmark_key.weight.grad)
        assert all(bool(p.grad.abs().sum() > 0) for p in model.query_proj.parameters())
    assert not torch.allclose(*grads)


def test_a_session_reads_the_neighbors():
    model = tiny_drt()
    ids = torch.randint(0, 256, (1, 60))
    set_retrieval_neighbors(model, "1:1")
    streamed = model.new_session().prefill(ids)
    torch.testing.assert_close(streamed, tiny_drt(1, 1).new_session().prefill(ids), rtol=0, atol=0)
    assert not torch.allclose(streamed, tiny_drt().new_session().prefill(ids), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("value", ["x", "1:2:3", "-1"])
def test_a_command_refuses_malformed_neighbors_in_one_line_before_loading(drt_dir, value, capsys):
    argv = ["eval", "passkey", "--model", str(drt_dir), "--filler", "repeat", "--lengths", "96"]
    assert main([*argv, f"--retrieval-neighbors={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "BEFORE:AFTER" in err


def test_retrieval_inspection_reads_and_records_the_neighbors_it_is_told(drt_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the pass key is 12345. remember it. " * 6)
    out = tmp_path / "retrieval.json"
    argv = ["eval", "retrieval", "--model", str(drt_dir), "--text", str(text), "--retrieval-neighbors", "0:1"]
    assert main([*argv, "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["retrieval_neighbors"] == [0, 1]
    items = [item for record in written["records"] for group in record["groups"] for item in group]
    assert any(item["neighbor"] for item in items) and any(not item["neighbor"] for item in items)
