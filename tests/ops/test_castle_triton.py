"""Triton CASTLE kernels against the dense reference: natively on CUDA, else on CPU through the
interpreter (TRITON_INTERPRET must be set before farsight.ops.castle.triton is first imported;
see tests/ops/test_gca_triton.py). CPU shapes stay tiny: the interpreter runs every program in
Python. The `slow` CUDA test covers realistic shapes and bf16 natively.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import farsight.ops.castle as castle_ops  # noqa: E402
import farsight.ops.castle.triton as castle_triton  # noqa: E402
from farsight.errors import InputError  # noqa: E402
from farsight.ops.castle import (  # noqa: E402
    castle_attention,
    castle_decode,
    castle_parallel_reference,
    castle_prefill,
)
from farsight.ops.castle.triton import INTERPRETED, castle_attention_triton, castle_prefill_triton  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if CUDA else "cpu"
# (atol, rtol); for fp16/bf16 atol is relative to the largest reference value, because the
# kernels round probabilities and intermediate sums to the input dtype before their dots.
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}
NAMES = ("o", "dqu", "dku", "dvu", "dqc", "dkc", "dvc")


def make_inputs(batch, steps, heads, dim, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, steps, heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(6)]


def outputs_and_grads(fn, inputs, **kwargs) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [out.detach(), *torch.autograd.grad(out, leaves, cotangent)]


def assert_matches_reference(inputs, window, tolerance=None, **kwargs) -> None:
    """Kernel vs the fp64 dense reference on the same (rounded) inputs: output and six gradients."""
    dtype = inputs[0].dtype
    atol, rtol = tolerance or TOLERANCE[dtype]
    got = outputs_and_grads(castle_attention_triton, inputs, window=window, **kwargs)
    want = outputs_and_grads(castle_parallel_reference, [x.double() for x in inputs], window=window)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype, name
        scaled_atol = atol if dtype == torch.float32 else atol * w.abs().max().item()
        torch.testing.assert_close(g.double(), w, atol=scaled_atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def test_kernels_are_interpreted_on_cpu() -> None:
    assert CUDA or INTERPRETED, (
        "farsight.ops.castle.triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
        "were compiled for a GPU; set the variable before the first import"
    )


# block=16 with T = 17 / 40 / 70: several key blocks, a partial last block; windows 1, 5 and 20
# take the "far" launch (P[J, I] = 0 beyond the first two or three block diagonals), None does not.
@pytest.mark.parametrize(
    "steps,dim,heads,window",
    [
        (1, 8, 1, None),
        (17, 8, 2, None),
        (17, 16, 1, 1),
        (40, 16, 1, None),
        (40, 8, 2, 5),
        (40, 16, 1, 1),
        (70, 8, 1, 20),
    ],
)
def test_fp32_matches_reference(steps, dim, heads, window) -> None:
    assert_matches_reference(make_inputs(2, steps, heads, dim), window, block=16)


@pytest.mark.parametrize("steps,window", [(17, None), (40, 5)])
def test_fp16_matches_reference(steps, window) -> None:
    assert_matches_reference(make_inputs(1, steps, 2, 16, torch.float16), window, block=16)


def test_bf16_inputs() -> None:
    # Under the interpreter bf16 runs in fp32 (its bf16 tl.dot is wrong); natively it is bf16.
    assert_matches_reference(make_inputs(1, 17, 1, 8, torch.bfloat16), 3, block=16)


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_grouped_forward_any_group_size(group, window) -> None:
    # T = 70 in 16-row blocks: 5 query blocks, so groups of 2 and 3 leave a partial last group;
    # window 5 makes most key blocks far (final sums from dsum), 20 spans group boundaries.
    assert_matches_reference(make_inputs(1, 70, 2, 8), window, block=16, group=group)


@pytest.mark.parametrize("window", [None, 20])
def test_backward_tile_differs_from_the_forwards(window) -> None:
    # The backward reads per-row sums and logsumexps, so it may walk smaller tiles than the forward.
    assert castle_triton.backward_block(64, 64) == 32 and castle_triton.backward_block(32, 128) == 16
    assert_matches_reference(make_inputs(1, 70, 2, 8), window, block=32, backward_block=16)


@pytest.mark.parametrize(
    "steps,window,dtype,blocks",
    [
        (17, None, torch.float32, dict(block=16)),
        (40, 5, torch.float32, dict(block=16)),
        (70, 20, torch.float32, dict(block=32, backward_block=16)),
        (40, None, torch.float16, dict(block=16)),
    ],
)
def test_backward_in_passes(monkeypatch, steps, window, dtype, blocks) -> None:
    # The values pass and the lookahead pass together give the fused kernel's six gradients:
    # several key blocks, a partial last block, far tiles (window 5), a backward tile smaller
    # than the forward's, and half precision.
    monkeypatch.setattr(castle_triton, "BACKWARD", "passes")
    assert_matches_reference(make_inputs(1, steps, 2, 8, dtype), window, **blocks)


def test_unknown_backward_layout_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(castle_triton, "BACKWARD", "fast")
    inputs = [x.requires_grad_(True) for x in make_inputs(1, 17, 1, 8)]
    out = castle_attention_triton(*inputs, block=16)
    with pytest.raises(InputError, match="FARSIGHT_CASTLE_BACKWARD"):
        out.sum().backward()


def test_prefill_lookahead_keys_do_not_depend_on_the_group() -> None:
    inputs = make_inputs(1, 70, 2, 8)
    outs = [castle_prefill_triton(*inputs, window=20, block=16, group=g) for g in (1, 2, 5)]
    for out, keys in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(keys, outs[0][1], atol=1e-6, rtol=1e-6)


def test_default_tile_and_odd_head_dim() -> None:
    # d = 5 is padded to a 16-wide tile; T = 20 with the default tile (32) is one partial block.
    assert_matches_reference(make_inputs(1, 20, 1, 5), None)
    assert_matches_reference(make_inputs(1, 20, 1, 5), 4)


def test_matches_cpu_path_through_dispatch() -> None:
    inputs = make_inputs(1, 40, 2, 8)
    got = outputs_and_grads(castle_attention, inputs, window=7, backend="triton")
    want = outputs_and_grads(castle_attention, inputs, window=7, backend="torch", block_size=16)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_non_contiguous_inputs_and_partial_grads() -> None:
    # Slices of one fused projection, as the CASTLE layer produces them; only some need grads.
    fused = torch.randn(1, 17, 2, 6 * 8, device=DEVICE)
    views = list(fused.split(8, dim=-1))
    want = castle_parallel_reference(*[v.double() for v in views], window=2)
    leaf = views[3].clone().requires_grad_(True)
    out = castle_attention_triton(*views[:3], leaf, *views[4:], window=2, block=16)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


def test_empty_sequence() -> None:
    inputs = [x.requires_grad_(True) for x in make_inputs(1, 0, 2, 8)]
    out = castle_attention_triton(*inputs)
    assert out.shape == (1, 0, 2, 8)
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in inputs)


@pytest.mark.parametrize("window", [None, 3])
def test_prefill_then_decode(window) -> None:
    inputs = make_inputs(1, 23, 2, 8)
    full = castle_parallel_reference(*inputs, window=window)
    out, cache = castle_prefill(*(x[:, :20] for x in inputs), window=window, backend="triton")
    _, torch_cache = castle_prefill(*(x[:, :20] for x in inputs), window=window, backend="torch")
    torch.testing.assert_close(out, full[:, :20], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cache.u, torch_cache.u, atol=2e-5, rtol=1e-4)
    for t in range(20, 23):
        step, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
        torch.testing.assert_close(step, full[:, t : t + 1], atol=2e-5, rtol=1e-4)


def test_autograd_saves_nothing_quadratic() -> None:
    steps = 64
    inputs = [x.requires_grad_(True) for x in make_inputs(1, steps, 1, 8)]
    sizes: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        castle_attention_triton(*inputs, block=16)
    assert max(sizes) <= steps * 8


def test_auto_picks_the_torch_path_on_cpu(monkeypatch) -> None:
    if CUDA:
        pytest.skip("auto picks Triton on CUDA")

    def fail(*args, **kwargs):
        raise AssertionError("auto dispatched CPU tensors to Triton")

    monkeypatch.setattr(castle_ops, "castle_attention_triton", fail)
    castle_attention(*make_inputs(1, 5, 1, 4), backend="auto")


def test_bad_arguments() -> None:
    inputs = make_inputs(1, 5, 1, 4)
    with pytest.raises(ValueError, match="block must be a power of two >= 16"):
        castle_attention_triton(*inputs, block=24)
    with pytest.raises(TypeError, match="not float64; use backend='torch'"):
        castle_attention_triton(*[x.double() for x in inputs])
    with pytest.raises(TypeError, match="not float64; use backend='torch'"):
        castle_prefill_triton(*[x.double() for x in inputs])
    with pytest.raises(ValueError, match="backend must be one of"):
        castle_attention(*inputs, backend="flash")
    with pytest.raises(ValueError, match="backend must be one of"):
        castle_prefill(*inputs, backend="reference")
    with pytest.raises(ValueError, match="window"):
        castle_attention(*inputs, window=0, backend="triton")


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="native Triton run needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_large_shapes(dtype, window, dim) -> None:
    # Against the blockwise torch path in fp32 (the dense reference would need T^3 work).
    inputs = make_inputs(2, 1000, 4, dim, dtype)
    got = outputs_and_grads(castle_attention, inputs, window=window, backend="triton")
    want = outputs_and_grads(castle_attention, [x.float() for x in inputs], window=window, backend="torch")
    atol, rtol = TOLERANCE[dtype]
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype, name
        scaled_atol = atol * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.float(), w, atol=scaled_atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
