"""CASTLE ops: recurrent definition == dense Theorem-1 form == blockwise autograd Function,
inference (prefill + decode) == training forward, causality, validation and memory."""

from __future__ import annotations

import pytest
import torch

from farsight.ops.castle import (
    CastleCache,
    castle_attention,
    castle_decode,
    castle_parallel_reference,
    castle_prefill,
    castle_recurrent,
    inference,
)

NAMES = ("qu", "ku", "vu", "qc", "kc", "vc")


@pytest.fixture(params=["in place", "held back"])
def decode_update(request, monkeypatch):
    """Run a test with each way a decode step updates U: in place (the default below
    HOLD_BACK_FROM_ROWS rows, which every small test stays under) and held back from one row on."""
    if request.param == "held back":
        monkeypatch.setattr(inference, "HOLD_BACK_FROM_ROWS", 1)
    return request.param


def make_inputs(batch, steps, heads, dim, dtype=torch.float64, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, steps, heads, dim, generator=gen, dtype=dtype).requires_grad_(requires_grad) for _ in NAMES
    ]


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# (T, d, H, window, block_size): the full T list and every window kind at d=8, plus a few
# cases at d=64 / H=3; block sizes 16 and 64 give several blocks and partial last blocks, and
# 128 (the default) splits each key block into row sub-blocks.
FP64_CASES = [
    (steps, 8, 1, window, block)
    for steps in (1, 2, 63, 64, 65, 130)
    for window, block in ((None, 16), (1, 16), (7, 64), ("T", 16))
] + [
    (65, 64, 3, None, 64),
    (130, 64, 3, 7, 16),
    (64, 64, 1, "T", 64),
    (130, 8, 3, None, 64),
    (130, 8, 1, None, 128),
    (130, 8, 3, 7, 128),
    (200, 8, 1, 70, 128),
]


@pytest.mark.parametrize("steps,dim,heads,window,block", FP64_CASES)
def test_fp64_recurrent_parallel_blockwise_agree(steps, dim, heads, window, block):
    window = steps if window == "T" else window
    inputs = make_inputs(2, steps, heads, dim, requires_grad=True)
    recurrent = castle_recurrent(*inputs, window=window)
    parallel = castle_parallel_reference(*inputs, window=window)
    blockwise = castle_attention(*inputs, window=window, block_size=block)
    assert blockwise.shape == (2, steps, heads, dim) and blockwise.dtype == torch.float64
    assert max_diff(recurrent, parallel) < 1e-10
    assert max_diff(blockwise, parallel) < 1e-10
    grad_out = torch.randn_like(parallel)
    for name, want, got in zip(NAMES, grads(parallel, inputs, grad_out), grads(blockwise, inputs, grad_out)):
        assert max_diff(want, got) < 1e-10, name


@pytest.mark.parametrize("window", [None, 2])
def test_gradcheck(window):
    inputs = make_inputs(1, 5, 2, 3, requires_grad=True, seed=1)
    assert torch.autograd.gradcheck(
        lambda *xs: castle_attention(*xs, window=window, block_size=2), inputs, eps=1e-6, atol=1e-7
    )


def test_block_size_does_not_change_results():
    inputs = make_inputs(1, 150, 2, 8)
    want = castle_parallel_reference(*inputs, window=9)
    for block in (1, 7, 32, 40, 96, 128, 256):
        assert max_diff(castle_attention(*inputs, window=9, block_size=block), want) < 1e-12


def test_fp32_long_sequence_matches_fp64_reference():
    exact = make_inputs(1, 1000, 1, 32, seed=3)
    inputs64 = [x.clone().requires_grad_() for x in exact]
    inputs32 = [x.float().requires_grad_() for x in exact]
    want = castle_parallel_reference(*inputs64)
    got = castle_attention(*inputs32)
    assert got.dtype == torch.float32
    assert max_diff(got, want) < 1e-4
    grad_out = torch.randn_like(want)
    for name, w, g in zip(NAMES, grads(want, inputs64, grad_out), grads(got, inputs32, grad_out.float())):
        assert g.dtype == torch.float32
        assert max_diff(g, w) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    inputs = [x.to(dtype).requires_grad_() for x in make_inputs(2, 70, 2, 16, dtype=torch.float32)]
    inputs32 = [x.detach().float().requires_grad_() for x in inputs]
    out = castle_attention(*inputs, window=5, block_size=16)
    want = castle_attention(*inputs32, window=5, block_size=16)
    assert out.dtype == dtype
    assert max_diff(out, want) < 2e-2
    grad_out = torch.randn_like(want)
    for name, g, w in zip(NAMES, grads(out, inputs, grad_out.to(dtype)), grads(want, inputs32, grad_out)):
        assert g.dtype == dtype, name
        assert max_diff(g, w) < 5e-2 * max(1.0, w.abs().max().item()), name


def test_empty_sequence():
    inputs = make_inputs(2, 0, 3, 4, requires_grad=True)
    out = castle_attention(*inputs)
    assert out.shape == (2, 0, 3, 4)
    out.sum().backward()
    assert inputs[0].grad.shape == inputs[0].shape


def test_non_contiguous_inputs():
    inputs = make_inputs(2, 33, 3, 8)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs]
    assert not strided[0].is_contiguous()
    assert max_diff(castle_attention(*strided, block_size=16), castle_parallel_reference(*inputs)) < 1e-12


@pytest.mark.parametrize("window", [None, 1, 5, 100])
@pytest.mark.parametrize("prefix", [0, 1, 17, 40])
def test_prefill_then_decode_matches_attention(window, prefix, decode_update):
    steps = 40
    inputs = make_inputs(2, steps, 2, 16, dtype=torch.float32, seed=4)
    full = castle_attention(*inputs, window=window, block_size=16)
    out, cache = castle_prefill(*(x[:, :prefix] for x in inputs), window=window, block_size=16, layer="L3")
    outs = [out]
    for t in range(prefix, steps):
        step_out, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache, layer="L3", position=t)
        outs.append(step_out)
    assert cache.length == steps
    assert max_diff(torch.cat(outs, dim=1), full) < 1e-5
    # The cache after decoding matches the cache a prefill of the whole sequence builds.
    _, whole = castle_prefill(*inputs, window=window, block_size=16)
    for got, want in zip(cache.tensors(), whole.tensors()):
        assert max_diff(got, want) < 1e-5


def test_prefill_lookahead_keys_follow_the_definition():
    steps, window = 37, 6
    inputs = make_inputs(1, steps, 2, 8, seed=5)
    qu, ku, vu = (x.transpose(1, 2) for x in inputs[:3])
    _, cache = castle_prefill(*inputs, window=window, block_size=8)
    scale = 8**-0.5
    b = torch.arange(steps)[:, None]
    c = torch.arange(steps)[None, :]
    mask = (c > b) & (c <= b + window)
    want = (torch.sigmoid(scale * qu @ ku.transpose(-1, -2)) * mask) @ vu
    assert max_diff(cache.tensors()[0], want) < 1e-12
    assert cache.tensors()[0][:, :, -1].abs().max() == 0


def test_half_precision_decode(decode_update):
    inputs = make_inputs(1, 20, 2, 8, dtype=torch.float32, seed=7)
    half = [x.bfloat16() for x in inputs]
    want = castle_attention(*(x.float() for x in half), window=4)
    out, cache = castle_prefill(*(x[:, :12] for x in half), window=4)
    assert cache.u.dtype == torch.float32 and cache.input_dtype == torch.bfloat16
    outs = [out]
    for t in range(12, 20):
        step_out, cache = castle_decode(*(x[:, t : t + 1] for x in half), cache)
        outs.append(step_out)
    got = torch.cat(outs, dim=1)
    assert got.dtype == torch.bfloat16
    assert max_diff(got, want) < 2e-2


def test_empty_cache_equals_empty_prefill():
    inputs = make_inputs(1, 6, 2, 4, dtype=torch.float32)
    _, from_prefill = castle_prefill(*(x[:, :0] for x in inputs), window=3)
    from_empty = CastleCache.empty(1, 2, 4, dtype=torch.float32, window=3)
    for t in range(6):
        token = [x[:, t : t + 1] for x in inputs]
        a, from_prefill = castle_decode(*token, from_prefill)
        b, from_empty = castle_decode(*token, from_empty)
        assert torch.equal(a, b)
    assert from_empty.capacity >= 6


def test_decode_leaves_rows_outside_the_window_alone(decode_update):
    inputs = make_inputs(1, 30, 1, 4, dtype=torch.float32)
    _, cache = castle_prefill(*(x[:, :29] for x in inputs), window=4)
    before = cache.u[:, :, :29].clone()
    _, cache = castle_decode(*(x[:, 29:30] for x in inputs), cache)
    assert torch.equal(cache.u[:, :, :25], before[:, :, :25])
    assert not torch.equal(cache.u[:, :, 25:29], before[:, :, 25:29])


@pytest.mark.parametrize("window", [None, 2, 21])
def test_long_decode_is_exact_while_the_cache_grows(window, decode_update):
    """fp64, 75 decode steps from a 3-token prompt: the buffers grow several times, and the
    cache's U equals a prefill's at every check."""
    steps, prompt = 78, 3
    inputs = make_inputs(2, steps, 3, 5, seed=11)
    want = castle_parallel_reference(*inputs, window=window)
    out, cache = castle_prefill(*(x[:, :prompt] for x in inputs), window=window, block_size=8)
    outs = [out]
    for t in range(prompt, steps):
        step_out, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
        outs.append(step_out)
        if t in (20, 60):
            _, whole = castle_prefill(*(x[:, : t + 1] for x in inputs), window=window, block_size=8)
            assert max_diff(cache.u, whole.u) < 1e-12
    assert max_diff(torch.cat(outs, dim=1), want) < 1e-12
    _, whole = castle_prefill(*inputs, window=window, block_size=8)
    for got, expected in zip(cache.tensors(), whole.tensors()):
        assert max_diff(got, expected) < 1e-12


@pytest.mark.parametrize("window", [None, 7])
def test_held_back_updates_fold_every_pending_steps(monkeypatch, window):
    """From HOLD_BACK_FROM_ROWS rows on, a step leaves U's storage as it is and the cache folds
    the held-back updates in every PENDING_STEPS steps or when U is read; outputs and U stay the
    definition's (fp64, against a prefill of the same tokens)."""
    monkeypatch.setattr(inference, "HOLD_BACK_FROM_ROWS", 5)
    steps, prompt = 12 + inference.PENDING_STEPS + 5, 12
    inputs = make_inputs(1, steps, 2, 4, seed=12)
    want = castle_parallel_reference(*inputs, window=window)
    out, cache = castle_prefill(*(x[:, :prompt] for x in inputs), window=window)
    stored = cache._u.view().clone()
    outs, held = [out], 0
    for t in range(prompt, steps):
        step_out, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
        outs.append(step_out)
        held = (held + 1) % inference.PENDING_STEPS
        assert cache.pending == held
        if t == prompt + 2:
            assert torch.equal(cache._u.view()[:, :, :prompt], stored)  # three steps held back, U not written
            _, whole = castle_prefill(*(x[:, : t + 1] for x in inputs), window=window)
            assert max_diff(cache.u, whole.u) < 1e-12  # reading U folds them in
            assert cache.pending == 0
            held = 0
    assert max_diff(torch.cat(outs, dim=1), want) < 1e-12
    _, whole = castle_prefill(*inputs, window=window)
    for got, expected in zip(cache.tensors(), whole.tensors()):
        assert max_diff(got, expected) < 1e-12


def test_held_back_updates_fold_after_inference_mode(monkeypatch):
    """A cache decoded under torch.inference_mode() holds inference tensors; reading its U
    afterwards still folds the held-back steps in."""
    monkeypatch.setattr(inference, "HOLD_BACK_FROM_ROWS", 1)
    inputs = make_inputs(1, 14, 2, 4, seed=14)
    with torch.inference_mode():
        _, cache = castle_prefill(*(x[:, :10] for x in inputs))
        for t in range(10, 14):
            _, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
    assert cache.pending == 4
    _, whole = castle_prefill(*inputs)
    assert max_diff(cache.u, whole.u) < 1e-12


def test_short_contexts_update_u_in_place():
    inputs = make_inputs(1, 20, 2, 4, seed=13)
    _, cache = castle_prefill(*(x[:, :10] for x in inputs))
    for t in range(10, 20):
        _, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
        assert cache.pending == 0


@pytest.mark.parametrize("window", [None, 3])
def test_causality(window):
    steps, cut = 50, 20
    inputs = make_inputs(1, steps, 2, 8, seed=6)
    base = castle_attention(*inputs, window=window, block_size=16)
    for i in range(len(NAMES)):
        changed = [x.clone() for x in inputs]
        changed[i][:, cut + 1 :] += torch.randn_like(changed[i][:, cut + 1 :])
        out = castle_attention(*changed, window=window, block_size=16)
        assert torch.equal(out[:, : cut + 1], base[:, : cut + 1]), NAMES[i]
        assert not torch.equal(out[:, cut + 1 :], base[:, cut + 1 :]), NAMES[i]


def test_autograd_saves_nothing_quadratic():
    steps = 256
    inputs = make_inputs(1, steps, 1, 16, dtype=torch.float32, requires_grad=True)
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = castle_attention(*inputs, block_size=32)
    out.sum().backward()
    assert saved, "expected the inputs, output and logsumexp to be saved"
    assert max(saved) <= steps * 16 < steps * steps
    assert len(saved) == 8


OPS = [castle_attention, castle_parallel_reference, castle_recurrent]


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_rejects_mismatched_shapes(op):
    inputs = make_inputs(1, 4, 2, 8)
    inputs[4] = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="kc must have shape"):
        op(*inputs)
    inputs = make_inputs(1, 4, 2, 8)
    inputs[2] = inputs[2][:, :, :1]  # would broadcast over heads; must not
    with pytest.raises(ValueError, match="vu must have shape"):
        op(*inputs)
    inputs = make_inputs(1, 4, 2, 8)
    inputs[0] = inputs[0][0]
    with pytest.raises(ValueError, match="qu must have 4 dimensions"):
        op(*inputs)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_rejects_mismatched_dtypes_and_devices(op):
    inputs = make_inputs(1, 4, 2, 8)
    inputs[5] = inputs[5].float()
    with pytest.raises(TypeError, match="vc has dtype torch.float32"):
        op(*inputs)
    inputs = make_inputs(1, 4, 2, 8)
    inputs[1] = torch.empty(1, 4, 2, 8, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match="ku is on meta"):
        op(*inputs)
    inputs = [torch.ones(1, 4, 2, 8, dtype=torch.long) for _ in NAMES]
    with pytest.raises(TypeError, match="floating-point"):
        op(*inputs)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "7"])
def test_rejects_bad_window(window):
    inputs = make_inputs(1, 4, 1, 8)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        castle_attention(*inputs, window=window)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        castle_prefill(*inputs, window=window)


def test_rejects_bad_block_size_and_scale():
    inputs = make_inputs(1, 4, 1, 8)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        castle_attention(*inputs, block_size=0)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        castle_attention(*inputs, scale=float("nan"))


def test_decode_rejects_bad_calls():
    inputs = make_inputs(2, 6, 2, 8, dtype=torch.float32)
    token = [x[:, 5:6] for x in inputs]
    _, cache = castle_prefill(*(x[:, :5] for x in inputs), window=3, layer=0)
    with pytest.raises(ValueError, match="exactly one new token"):
        castle_decode(*(x[:, 3:5] for x in inputs), cache)
    with pytest.raises(ValueError, match="belongs to layer 0"):
        castle_decode(*token, cache, layer=1)
    with pytest.raises(ValueError, match="built with window=3 but window=None"):
        castle_decode(*token, cache, window=None)
    with pytest.raises(ValueError, match="built with scale"):
        castle_decode(*token, cache, scale=1.0)
    with pytest.raises(ValueError, match="out of sync"):
        castle_decode(*token, cache, position=7)
    with pytest.raises(ValueError, match=r"must have shape \[2, 1, 2, 8\]"):
        castle_decode(*(x[:, :, :1] for x in token), cache)
    with pytest.raises(TypeError, match="cache was built for torch.float32"):
        castle_decode(*(x.double() for x in token), cache)
    with pytest.raises(TypeError, match="must be a CastleCache"):
        castle_decode(*token, cache.tensors())
    assert cache.length == 5  # nothing above touched the cache
    castle_decode(*token, cache, layer=0, window=3, position=5)
    assert cache.length == 6
