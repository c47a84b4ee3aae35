"""The chunked cross-entropy of loss-only forwards equals the plain loss; small vocabularies keep it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from farsight.models import TransformerConfig, TransformerForCausalLM
from farsight.models.lm import CHUNKED_LOSS_MIN_VOCAB, causal_lm_loss, chunked_causal_lm_loss


def _inputs(dtype=torch.float32, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 37, 16, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 16, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 37), generator=gen)
    labels[0, 5] = labels[1, -1] = -100
    weights = torch.rand(2, 37, generator=gen)
    return hidden, weight, labels, weights


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("rows", [1, 10, 4096])
def test_chunked_loss_equals_the_plain_loss(with_weights, rows):
    hidden, weight, labels, weights = _inputs()
    weights = weights if with_weights else None
    want = causal_lm_loss(hidden @ weight.t(), labels, weights)
    got = chunked_causal_lm_loss(hidden, weight, labels, weights, rows=rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * w.abs().max().item())


def test_chunked_loss_under_bf16_autocast_takes_bf16_products():
    hidden, weight, labels, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = causal_lm_loss(F.linear(hidden, weight), labels)
        got = chunked_causal_lm_loss(hidden, weight, labels, rows=16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.parametrize("vocab", [300, CHUNKED_LOSS_MIN_VOCAB])
def test_a_loss_only_forward_gives_the_loss_of_the_full_forward(vocab, monkeypatch):
    import farsight.models.lm as lm

    calls = []
    chunked = lm.chunked_causal_lm_loss
    monkeypatch.setattr(lm, "chunked_causal_lm_loss", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    torch.manual_seed(0)
    model = TransformerForCausalLM(TransformerConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2))
    ids = torch.randint(0, vocab, (2, 24))
    full = model(ids, labels=ids)
    loss_only = model(ids, labels=ids, return_logits=False)
    assert full.logits is not None and loss_only.logits is None
    torch.testing.assert_close(loss_only.loss, full.loss, rtol=1e-6, atol=0)
    assert len(calls) == (vocab >= CHUNKED_LOSS_MIN_VOCAB)
    without_labels = model(ids, return_logits=False)
    assert without_labels.loss is None and without_labels.logits is not None
