import numpy as np
import pytest
import torch

from farsight.data.token_files import load_token_dataset, prepare_corpus
from farsight.data.tokenizers import load_tokenizer
from farsight.eval.perplexity import draw_windows, evaluate_perplexity, format_error, paired_difference, token_nll
from farsight.eval.retrieval import format_retrieval, inspect_retrieval
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

TOK = load_tokenizer("byte")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    docs = root / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text((f"alpha beta gamma delta {i} ") * (40 + 30 * i))
    prepare_corpus([str(docs)], TOK, root / "tok", val_fraction=0.5, progress=False)
    return load_token_dataset(root / "tok", "val")


def models():
    torch.manual_seed(0)
    drt = DRTForCausalLM(
        DRTConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, chunk_size=8, window=16, top_k=2, encoder_layers=1)
    )
    base = TransformerForCausalLM(
        TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, attention="sliding", window=16)
    )
    return [drt.eval(), base.eval()]


def test_windows_are_deterministic_disjoint_and_inside_documents(split):
    a, source = draw_windows(split, 300, 4, seed=1)
    b, _ = draw_windows(split, 300, 4, seed=1)
    assert np.array_equal(a, b) and a.shape == (4, 300) and source == "documents"
    tokens = np.asarray(split.tokens[:])
    starts = []
    for row in a:
        hits = [o for o in range(len(tokens) - 299) if np.array_equal(tokens[o : o + 300], row)]
        assert hits
        starts.append(hits[0])
        doc = [(s, e) for s, e in split.documents() if s <= hits[0] < e][0]
        assert hits[0] + 300 <= doc[1]
    starts.sort()
    assert all(later - earlier >= 300 for earlier, later in zip(starts, starts[1:]))
    _, source = draw_windows(split, len(split) - 10, 1, seed=1)
    assert source == "concatenated"
    with pytest.raises(ValueError, match="fewer than the .*-token windows drawn from it"):
        draw_windows(split, len(split) + 1, 1, seed=0)
    with pytest.raises(ValueError, match=r"holds 2 disjoint windows .* --windows 2"):
        draw_windows(split, len(split) // 2, 3, seed=0)


@pytest.mark.parametrize("index", [0, 1])
def test_blockwise_streaming_nll_equals_the_parallel_loss(split, index):
    model = models()[index]
    windows = torch.from_numpy(draw_windows(split, 150, 2, seed=0)[0])
    streamed = token_nll(model, windows, block=37, memory="device")
    assert streamed.shape == (2, 149) and streamed.dtype == torch.float64
    for row in range(2):
        x = windows[row : row + 1]
        torch.testing.assert_close(streamed[row].mean().float(), model(x, labels=x).loss, atol=1e-4, rtol=1e-4)
        # Position by position: the NLL of the first 60 tokens is the loss of the 60-token prefix.
        torch.testing.assert_close(
            streamed[row, :59].mean().float(), model(x[:, :60], labels=x[:, :60]).loss, atol=1e-4, rtol=1e-4
        )


def test_every_length_is_a_prefix_of_the_same_windows(split):
    model = models()[0]
    out = evaluate_perplexity(model, split, [64, 128], windows=3, batch_size=2, progress=False)
    assert set(out["by_length"]) == {"64", "128"} and out["window_length"] == 128
    row = out["by_length"]["128"]
    assert row["windows"] == 3 and row["ppl"] == pytest.approx(np.exp(row["nll"]))
    assert row["nll_sem"] == pytest.approx(row["nll_std"] / np.sqrt(3))
    windows = torch.from_numpy(draw_windows(split, 128, 3, seed=0)[0])
    for length in (64, 128):
        with torch.no_grad():
            losses = [model(w[None, :length], labels=w[None, :length]).loss for w in windows]
        assert out["by_length"][str(length)]["nll"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-4)


def test_a_longer_window_length_scores_the_start_of_the_same_windows(split):
    model = models()[1]
    full = evaluate_perplexity(model, split, [64, 128], windows=2, batch_size=2, progress=False)
    short = evaluate_perplexity(model, split, [64], windows=2, batch_size=2, progress=False, window_length=128)
    assert short["window_length"] == 128
    assert short["by_length"]["64"]["nll"] == pytest.approx(full["by_length"]["64"]["nll"], rel=1e-6)
    one = evaluate_perplexity(model, split, [64], windows=1, progress=False)["by_length"]["64"]
    assert (
        one["nll_std"] is None and one["nll_sem"] is None and format_error(one["nll_sem"]) == "n/a"
    )  # no spread from one window
    alone = evaluate_perplexity(model, split, [64], windows=2, batch_size=2, progress=False)
    assert alone["window_length"] == 64
    with pytest.raises(ValueError, match="shorter than the longest evaluation length"):
        evaluate_perplexity(model, split, [64], windows=1, progress=False, window_length=32)


def test_buckets_and_paired_differences(split):
    drt, base = models()
    a = evaluate_perplexity(drt, split, [128, 64], windows=3, batch_size=2, progress=False)
    b = evaluate_perplexity(base, split, [64, 128], windows=3, batch_size=2, progress=False)
    short, long = a["by_length"]["64"], a["by_length"]["128"]
    assert short["bucket_start"] == 1 and short["bucket_nll"] == pytest.approx(short["nll"])
    assert long["bucket_start"] == 64
    # The first 63 predicted tokens and the next 64 make up the 127 of the whole window.
    whole = (63 * np.array(short["window_nll"]) + 64 * np.array(long["window_bucket_nll"])) / 127
    assert np.allclose(whole, long["window_nll"])
    mean, sem = paired_difference(b["by_length"]["128"]["window_nll"], long["window_nll"])
    diff = np.array(b["by_length"]["128"]["window_nll"]) - np.array(long["window_nll"])
    assert mean == pytest.approx(diff.mean()) and sem == pytest.approx(diff.std(ddof=1) / np.sqrt(3))
    assert paired_difference([1.5], [1.0]) == (0.5, None)


def test_perplexity_rejects_no_lengths(split):
    with pytest.raises(ValueError, match="no evaluation lengths"):
        evaluate_perplexity(models()[0], split, [], windows=1, progress=False)


def test_retrieval_inspection_lists_past_chunks_with_text():
    model = models()[0]
    ids = torch.tensor(TOK.encode("def f(x): return x + 1\n" * 12))
    records = inspect_retrieval(model, ids)
    assert records and all(item["chunk"] < rec["chunk"] for rec in records for group in rec["groups"] for item in group)
    assert all(sum(i["weight"] for i in rec["groups"][0]) == pytest.approx(1.0) for rec in records)
    text = format_retrieval(records, ids, TOK, 8)
    assert "(query)" in text and "(target)" in text and "w=" in text
    with pytest.raises(ValueError, match="does not exist"):
        inspect_retrieval(model, ids, chunks=[999])
    with pytest.raises(TypeError, match="DRT"):
        inspect_retrieval(models()[1], ids)


def test_retrieval_inspection_marks_the_chunks_read_beside_the_retrieved_ones():
    from farsight.models import set_retrieval_neighbors

    model = models()[0]
    ids = torch.tensor(TOK.encode("def f(x): return x + 1\n" * 12))
    set_retrieval_neighbors(model, "0:1")
    records = inspect_retrieval(model, ids)
    top_k = model.config.top_k
    for rec in records:
        for group in rec["groups"]:
            retrieved = [item for item in group if not item["neighbor"]]
            beside = [item for item in group if item["neighbor"]]
            assert group == retrieved + beside and len(retrieved) <= top_k
            # each neighbor is the chunk after a retrieved one, weighed as it, and read once
            weights = {item["chunk"]: item["weight"] for item in retrieved}
            assert all(weights[item["chunk"] - 1] == item["weight"] for item in beside)
            assert len({item["chunk"] for item in group}) == len(group)
    assert any(item["neighbor"] for rec in records for group in rec["groups"] for item in group)
    assert "beside" in format_retrieval(records, ids, TOK, 8)
