import pytest
import torch

from farsight.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    alibi_slopes,
    rms_norm_reference,
    rotary_reference,
    swiglu_hidden_size,
    swiglu_reference,
)
from farsight.layers.attention import CausalSelfAttention, SlidingWindowAttention
from farsight.models import TransformerConfig


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


@pytest.mark.parametrize("kind,extra", [("causal", {}), ("sliding", {"window": 4}), ("sliding", {"window": 4, "position": "rope"})])
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


def test_rotary_frequencies_survive_a_cast_to_bf16():
    # a cast model keeps fp64 angles: a bf16-rounded frequency would be off by radians at 64K
    from farsight.layers import RotaryEmbedding, rotary_reference

    rope = RotaryEmbedding(16).to(torch.bfloat16)
    x = torch.randn(1, 3, 2, 16, dtype=torch.float64)
    got = rope(x, offset=65533)
    torch.testing.assert_close(got, rotary_reference(x, torch.arange(65533, 65536)), atol=1e-10, rtol=0)
