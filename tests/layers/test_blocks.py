import copy

import pytest
import torch
import torch.nn.functional as F

from farsight.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    alibi_slopes,
    attention,
    rms_norm_reference,
    rotary_reference,
    swiglu_hidden_size,
    swiglu_reference,
)
from farsight.layers.attention import (
    BidirectionalAttention,
    CausalSelfAttention,
    SlidingWindowAttention,
    attention_by_matmuls,
)
from farsight.models import DRTConfig, TransformerConfig
from tests.tolerance import RMS_RATIO, assert_close_rms


def test_rmsnorm_matches_reference_and_gradients():
    norm = RMSNorm(16, eps=1e-5).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    out = norm(x)
    ref = rms_norm_reference(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    assert norm(torch.randn(2, 16).bfloat16()).dtype == torch.bfloat16


def test_swiglu_matches_reference():
    mlp = SwiGLU(12, 20).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    gate, up = mlp.gate_up.weight.split(20)
    torch.testing.assert_close(mlp(x), swiglu_reference(x, gate, up, mlp.down.weight))
    assert swiglu_hidden_size(256) == 704 and swiglu_hidden_size(256) % 32 == 0


@pytest.mark.parametrize("offset", [0, 5, 1000])
def test_rotary_matches_complex_reference(offset):
    rope = RotaryEmbedding(8, theta=500.0)
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    out = rope(x, offset)
    ref = rotary_reference(x, torch.arange(offset, offset + 6), theta=500.0)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(rope(x, torch.arange(offset, offset + 6)), ref)


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    s1 = (rope(q, 10) * rope(k, 7)).sum()
    s2 = (rope(q, 103) * rope(k, 100)).sum()
    torch.testing.assert_close(s1, s2)


def test_alibi_slopes():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # non-power of two: the 4 slopes of n=4, then every other slope of n=8
    four = [2.0 ** (-2 * (i + 1)) for i in range(4)]
    eight = [2.0 ** -(i + 1) for i in range(8)]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(four + eight[0::2][:2]))
    with pytest.raises(ValueError):
        alibi_slopes(0)


def _config(**kw):
    return TransformerConfig(vocab_size=32, d_model=24, n_heads=3, n_layers=1, **kw)


def test_causal_attention_matches_explicit_softmax():
    attn = CausalSelfAttention(_config(position="none")).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(2, 9, 3, 3, 8).unbind(2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(2, 9, 24)
    torch.testing.assert_close(attn(x), attn.out(ref))


@pytest.mark.parametrize(
    "kind,extra", [("causal", {}), ("sliding", {"window": 4}), ("sliding", {"window": 4, "position": "rope"})]
)
def test_cached_decoding_equals_full_forward(kind, extra):
    cfg = _config(attention=kind, **extra)
    attn = (CausalSelfAttention if kind == "causal" else SlidingWindowAttention)(cfg).double()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    full = attn(x)
    cache = attn.new_cache()
    parts = [attn(x[:, :6], cache)] + [attn(x[:, i : i + 1], cache) for i in range(6, 9)] + [attn(x[:, 9:], cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full)
    assert cache.length == 11


def test_sliding_cache_keeps_only_the_window():
    attn = SlidingWindowAttention(_config(attention="sliding", window=5))
    cache = attn.new_cache()
    attn(torch.randn(1, 40, 24), cache)
    attn(torch.randn(1, 1, 24), cache)
    assert cache._k.shape[1] == 4


def test_sliding_with_window_covering_everything_is_causal_attention():
    cfg = _config(attention="sliding", window=64, position="rope")
    sliding = SlidingWindowAttention(cfg).double()
    causal = CausalSelfAttention(_config(attention="causal")).double()
    causal.load_state_dict(sliding.state_dict())
    x = torch.randn(1, 20, 24, dtype=torch.float64)
    torch.testing.assert_close(sliding(x), causal(x))


def test_causal_attention_hides_left_padding_as_the_sliding_window_does():
    cfg = _config(attention="sliding", window=64, position="rope")
    sliding = SlidingWindowAttention(cfg).double()
    causal = CausalSelfAttention(_config(attention="causal")).double()
    causal.load_state_dict(sliding.state_dict())
    x = torch.randn(2, 20, 24, dtype=torch.float64)
    pad = torch.tensor([0, 7])
    want = sliding(x, pad=pad)
    torch.testing.assert_close(causal(x, pad=pad), want)
    cache = causal.new_cache()
    parts = [causal(x[:, :5], cache, pad=pad)] + [causal(x[:, i : i + 1], cache, pad=pad) for i in range(5, 9)]
    torch.testing.assert_close(torch.cat([*parts, causal(x[:, 9:], cache, pad=pad)], 1), want)


def test_a_kv_cache_copy_is_a_snapshot():
    attn = CausalSelfAttention(_config(attention="causal")).double()
    x = torch.randn(1, 12, 24, dtype=torch.float64)
    cache = attn.new_cache()
    attn(x[:, :6], cache)
    snapshot = copy.copy(cache)
    attn(torch.randn(1, 4, 24, dtype=torch.float64), cache)  # a continuation that is undone
    torch.testing.assert_close(attn(x[:, 6:], snapshot), attn(x)[:, 6:])
    assert snapshot.length == 12


def test_rotary_frequencies_survive_a_cast_to_bf16():
    # a cast model keeps fp64 angles: a bf16-rounded frequency would be off by radians at 64K
    from farsight.layers import RotaryEmbedding, rotary_reference

    rope = RotaryEmbedding(16).to(torch.bfloat16)
    x = torch.randn(1, 3, 2, 16, dtype=torch.float64)
    got = rope(x, offset=65533)
    torch.testing.assert_close(got, rotary_reference(x, torch.arange(65533, 65536)), atol=1e-10, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_encoder_attention_by_matmuls_equals_sdpa(masked):
    # the CPU training path of DRT's chunk encoder against SDPA: outputs and all gradients, fp64,
    # odd sizes, with a key padding mask that leaves some rows only their own key
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None
    if masked:
        keep = torch.rand(3, 7) > 0.5
        mask = (keep[:, None, :] | torch.eye(7, dtype=torch.bool))[:, None]
    got = attention_by_matmuls(q, k, v, mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    cotangent = torch.randn_like(want)
    grads_got = torch.autograd.grad(got, (q, k, v), cotangent)
    grads_want = torch.autograd.grad(want, (q, k, v), cotangent)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_encoder_attention_takes_the_matmul_path_only_to_train_on_cpu(monkeypatch):
    cfg = DRTConfig(vocab_size=32, d_model=24, n_heads=3, n_layers=2, chunk_size=4, window=8, top_k=1, encoder_layers=1)
    attn = BidirectionalAttention(cfg)
    calls = []
    monkeypatch.setattr(
        attention,
        "attention_by_matmuls",
        lambda *a: calls.append(1) or F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]),
    )
    x = torch.randn(2, 5, 24, requires_grad=True)
    with torch.no_grad():
        inference = attn(x)
    training = attn(x)
    assert calls == [1]
    torch.testing.assert_close(training, inference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = attn(x)
    assert low.dtype == torch.bfloat16 and calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoder_attention_by_matmuls_in_low_precision(dtype):
    torch.manual_seed(1)
    q, k, v = (torch.randn(4, 2, 9, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    with torch.autocast("cpu", dtype=dtype):
        autocast = attention_by_matmuls(q.to(dtype), k.to(dtype), v.to(dtype))
    pure = attention_by_matmuls(q.to(dtype), k.to(dtype), v.to(dtype))
    for got in (autocast, pure):
        assert got.dtype == dtype
        assert_close_rms("attention_by_matmuls", want, got, RMS_RATIO[dtype])
