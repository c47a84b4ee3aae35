import numpy as np
import pytest
import torch

from farsight.data.token_files import load_token_dataset, prepare_corpus
from farsight.data.tokenizers import load_tokenizer
from farsight.eval.perplexity import draw_windows, evaluate_perplexity, window_nll
from farsight.eval.retrieval import format_retrieval, inspect_retrieval
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

TOK = load_tokenizer("byte")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    docs = root / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(("alpha beta gamma delta %d " % i) * (40 + 30 * i))
    prepare_corpus([str(docs)], TOK, root / "tok", val_fraction=0.5, progress=False)
    return load_token_dataset(root / "tok", "val")


def models():
    torch.manual_seed(0)
    drt = DRTForCausalLM(DRTConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, chunk_size=8, window=16, top_k=2, encoder_layers=1))
    base = TransformerForCausalLM(TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, attention="sliding", window=16))
    return [drt.eval(), base.eval()]


def test_windows_are_deterministic_and_inside_documents(split):
    a, source = draw_windows(split, 300, 4, seed=1)
    b, _ = draw_windows(split, 300, 4, seed=1)
    assert np.array_equal(a, b) and a.shape == (4, 300) and source == "documents"
    _, source = draw_windows(split, len(split) - 10, 1, seed=1)
    assert source == "concatenated"
    with pytest.raises(ValueError, match="fewer than the evaluation length"):
        draw_windows(split, len(split) + 1, 1, seed=0)


@pytest.mark.parametrize("index", [0, 1])
def test_blockwise_streaming_nll_equals_the_parallel_loss(split, index):
    model = models()[index]
    windows = torch.from_numpy(draw_windows(split, 150, 2, seed=0)[0])
    streamed = window_nll(model, windows, block=37, memory="device")
    for row in range(2):
        x = windows[row : row + 1]
        torch.testing.assert_close(streamed[row].float(), model(x, labels=x).loss, atol=1e-4, rtol=1e-4)


def test_evaluate_perplexity_reports_every_length(split):
    out = evaluate_perplexity(models()[0], split, [64, 128], windows=3, batch_size=2, progress=False)
    assert set(out["by_length"]) == {"64", "128"}
    row = out["by_length"]["128"]
    assert row["windows"] == 3 and row["ppl"] == pytest.approx(np.exp(row["nll"]))


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
