import pytest
import torch

from farsight.config import ConfigError
from farsight.layers import CastleAttention, CastleSWLAttention, castle_heads_for_parity
from farsight.models import TransformerConfig, TransformerForCausalLM
from farsight.ops.castle import castle_parallel_reference, inference


def config(kind="castle", **kw):
    extra = {"lookahead_window": 3} if kind == "castle-swl" else {}
    return TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, attention=kind, **extra, **kw)


@pytest.mark.parametrize("kind", ["castle", "castle-swl"])
def test_layer_matches_the_reference_op_on_its_projections(kind):
    layer = (CastleAttention if kind == "castle" else CastleSWLAttention)(config(kind)).double()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    inputs = layer._project(x, 0)
    want = layer.out(castle_parallel_reference(*inputs, window=layer.window).reshape(2, 13, -1))
    torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("kind", ["castle", "castle-swl"])
@pytest.mark.parametrize("prefix", [1, 6])
@pytest.mark.parametrize("held_back", [False, True])
def test_layer_prefill_then_decode_equals_parallel_forward(kind, prefix, held_back, monkeypatch):
    if held_back:  # every decode step holds its update of U back (the default does so from 2048 rows)
        monkeypatch.setattr(inference, "HOLD_BACK_FROM_ROWS", 1)
    layer = (CastleAttention if kind == "castle" else CastleSWLAttention)(config(kind))
    x = torch.randn(2, 15, 32)
    full = layer(x)
    cache = layer.new_cache()
    parts = [layer(x[:, :prefix], cache)] + [layer(x[:, i : i + 1], cache) for i in range(prefix, 12)]
    parts.append(layer(x[:, 12:], cache))  # a multi-token block after a prefix
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 15


def test_a_cache_from_another_layer_is_rejected():
    a, b = CastleAttention(config()), CastleAttention(config())
    cache = a.new_cache()
    a(torch.randn(1, 4, 32), cache)
    with pytest.raises(ValueError, match="belongs to layer"):
        b(torch.randn(1, 1, 32), cache)


def test_head_count_for_parameter_parity():
    assert castle_heads_for_parity(14) == 8 and castle_heads_for_parity(16) == 9 and castle_heads_for_parity(1) == 1
    std = TransformerForCausalLM(TransformerConfig(d_model=448, n_heads=14, n_layers=1))
    castle = TransformerForCausalLM(
        TransformerConfig(d_model=448, n_heads=8, head_dim=32, n_layers=1, attention="castle")
    )
    attn_std = sum(p.numel() for p in std.blocks[0].attn.parameters())
    attn_castle = sum(p.numel() for p in castle.blocks[0].attn.parameters())
    assert attn_castle == attn_std  # 7 * 8 == 4 * 14


@pytest.mark.parametrize("kind", ["castle", "castle-swl"])
def test_model_trains_and_greedy_generate_matches_full_forward(kind):
    torch.manual_seed(0)
    model = TransformerForCausalLM(config(kind))
    ids = torch.randint(0, 50, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3
    model.eval()
    out = model.generate(ids[:2, :6], 10, temperature=0)
    assert torch.equal(model(out).logits[:, 5:-1].argmax(-1), out[:, 6:])


def test_model_level_prefill_decode_and_causality():
    model = TransformerForCausalLM(config("castle-swl")).eval()
    ids = torch.randint(0, 50, (2, 20))
    full = model(ids).logits
    caches = model.new_caches()
    parts = [model(ids[:, :9], caches=caches).logits] + [
        model(ids[:, i : i + 1], caches=caches).logits for i in range(9, 20)
    ]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 50
    torch.testing.assert_close(model(changed).logits[:, :12], full[:, :12])


def test_lookahead_window_belongs_to_castle_swl_only():
    with pytest.raises(ConfigError, match="lookahead_window must be an integer >= 1"):
        TransformerConfig(attention="castle-swl")
    with pytest.raises(ConfigError, match="not used by attention='castle'"):
        TransformerConfig(attention="castle", lookahead_window=4)
