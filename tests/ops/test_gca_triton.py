"""Triton GCA kernels against the reference: natively on CUDA, else on CPU through the interpreter.

The kernels are created when farsight.ops.gca.triton is imported, so TRITON_INTERPRET must be
set before that import; pytest imports every test module at collection, before any test runs,
and no other module imports the kernels, so setting it here at the top is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import farsight.ops.gca.triton as gca_triton_module  # noqa: E402
from farsight.ops.gca import gca, gca_reference  # noqa: E402
from farsight.ops.gca.triton import INTERPRETED, gca_triton, row_layout  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter runs every program in Python: CPU shapes stay tiny, CUDA ones are realistic.
SMALL = dict(batch=2, n=3, m=4, s=7, heads=2, dim=5, n_slots=3)
LARGE = dict(batch=2, n=8, m=12, s=64, heads=4, dim=64, n_slots=8)
# (atol, rtol); for fp16/bf16 atol is relative to the largest reference value, because the
# kernels round probabilities and score gradients to the input dtype before their dots.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def make_inputs(
    batch: int,
    n: int,
    m: int,
    s: int,
    heads: int,
    dim: int,
    n_slots: int,
    lq: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """Random q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K] with empty slots,
    one query chunk with no chunk at all, and chunk 0 retrieved twice by one query chunk."""
    lq = s + 1 if lq is None else lq
    q = torch.randn(batch, n, lq, heads, dim, device=DEVICE)
    k, v = (torch.randn(batch, m, s, heads, dim, device=DEVICE) for _ in range(2))
    index = torch.randint(-1, m, (batch, n, n_slots), device=DEVICE)
    index[0, 0, :2] = 0
    index[-1, -1] = -1
    weight = torch.randn(batch, n, n_slots, device=DEVICE).softmax(dim=-1)
    return q.to(dtype), k.to(dtype), v.to(dtype), index, weight.to(dtype)


def key_mask_for(index: torch.Tensor, s: int, seed: int = 3) -> torch.Tensor:
    """A random key mask [B, n, K, S] with one slot fully masked and one slot's first half masked
    (a whole 16-row key tile when S = 20 and block_s = 16)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(*index.shape, s, generator=gen) > 0.3
    mask[0, 0, 0] = False
    mask[-1, 0, -1, : s // 2 + 6] = False
    return mask.to(index.device)


def outputs_and_grads(fn, q, k, v, index, weight, **kwargs) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, weight)]
    out = fn(leaves[0], leaves[1], leaves[2], index, leaves[3], **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (out * cotangent).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def assert_matches_reference(
    inputs: tuple[torch.Tensor, ...],
    softmax_one: bool = True,
    tolerance: tuple[float, float] | None = None,
    key_mask: torch.Tensor | None = None,
    **blocks,
) -> None:
    """Kernel vs the fp64 reference on the same (rounded) inputs, outputs and all gradients."""
    dtype = inputs[0].dtype
    atol, rtol = tolerance or TOLERANCE[dtype]
    got = outputs_and_grads(gca_triton, *inputs, softmax_one=softmax_one, key_mask=key_mask, **blocks)
    exact = [x.double() if x.is_floating_point() else x for x in inputs]
    want = outputs_and_grads(gca_reference, *exact, softmax_one=softmax_one, key_mask=key_mask)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dweight"), got, want):
        assert g.dtype == dtype, name
        scaled_atol = atol if dtype == torch.float32 else atol * w.abs().max().item()
        torch.testing.assert_close(g.double(), w, atol=scaled_atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
    empty = inputs[3] < 0
    assert bool((got[4][empty] == 0).all()), "empty slots must get exactly zero weight gradient"


def test_inverted_index_lists_each_chunks_retrievals() -> None:
    index = torch.tensor([[[1, -1], [0, 1]], [[-1, -1], [2, 2]]])  # B=2, n=2, K=2, m=3
    slots, offsets = gca_triton_module._retrievals_by_chunk(index, 3)
    by_chunk = [slots[offsets[c] : offsets[c + 1]].tolist() for c in range(6)]
    # global slot ids (b * n + t) * K + j; chunk ids b * m + c
    assert by_chunk == [[2], [0, 3], [], [], [], [6, 7]]


def test_kernels_are_interpreted_on_cpu() -> None:
    assert CUDA or INTERPRETED, (
        "farsight.ops.gca.triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
        "were compiled for a GPU; set the variable before the first import"
    )


@pytest.mark.parametrize("softmax_one", [True, False])
def test_matches_reference(softmax_one: bool) -> None:
    inputs = make_inputs(**(LARGE if CUDA else SMALL))
    assert_matches_reference(inputs, softmax_one)
    on, off = (gca_triton(*inputs, softmax_one=flag) for flag in (True, False))
    assert (on - off).abs().max() > 1e-3


@pytest.mark.parametrize("softmax_one", [True, False])
def test_several_tiles_per_chunk_and_query_blocks(softmax_one: bool) -> None:
    # S = 20 and Lq = 17 with 16-row tiles: two key tiles per chunk (the online softmax carries
    # over a tile boundary, the second tile is mostly padding) and two query-row blocks.
    inputs = make_inputs(batch=1, n=2, m=3, s=20, heads=2, dim=4, n_slots=2, lq=17)
    assert_matches_reference(inputs, softmax_one, block_q=16, block_s=16)


@pytest.mark.parametrize("softmax_one", [True, False])
@pytest.mark.parametrize("lq", [65, 130])
def test_landmark_row_rides_on_the_last_block(softmax_one: bool, lq: int) -> None:
    # DRT's query chunks have S + 1 rows: 64 in one block, the 65th as a 16-row tail tile (after
    # the last block in the forward, a program of its own in the backward).
    assert row_layout(65, None) == (64, 16, 64) and row_layout(130, None) == (64, 16, 128)
    assert row_layout(64, None) == (64, 0, 64) and row_layout(65, 64) == (64, 0, 65)
    assert row_layout(90, None) == (64, 0, 90)  # 26 rows left: a second block
    inputs = make_inputs(batch=1, n=3, m=3, s=20, heads=2, dim=8, n_slots=2, lq=lq)
    assert_matches_reference(inputs, softmax_one)


@pytest.mark.parametrize("softmax_one", [True, False])
def test_landmark_row_with_several_key_tiles_and_wide_heads(softmax_one: bool) -> None:
    # The tail tile with chunks of two key tiles (S = 20, 16-row key tiles: the key-major
    # kernel runs a program per key tile), and d = 72, padded to 128, where the key-major kernel
    # steps through the query rows 32 at a time (two steps, then the tail).
    assert gca_triton_module.kv_rows(64, 128) == 32 and gca_triton_module.kv_rows(64, 64) == 64
    inputs = make_inputs(batch=1, n=2, m=3, s=20, heads=1, dim=72, n_slots=2, lq=65)
    assert_matches_reference(inputs, softmax_one, block_s=16)


@pytest.mark.parametrize("softmax_one", [True, False])
@pytest.mark.parametrize("lq,blocks", [(65, {}), (17, {"block_q": 16, "block_s": 16})], ids=["one-tile", "tiles"])
def test_key_mask(softmax_one: bool, lq: int, blocks: dict) -> None:
    # One key tile per chunk with the landmark tail, and several key tiles (a whole tile masked)
    # with several query blocks; a fully masked slot adds zero for both softmax variants.
    inputs = make_inputs(batch=2, n=2, m=3, s=20, heads=2, dim=8, n_slots=3, lq=lq)
    mask = key_mask_for(inputs[3], 20)
    assert_matches_reference(inputs, softmax_one, key_mask=mask, **blocks)
    dispatched = gca(*inputs, softmax_one=softmax_one, key_mask=mask, backend="auto")
    torch.testing.assert_close(dispatched, gca(*inputs, softmax_one=softmax_one, key_mask=mask, backend="torch"))


def test_more_slots_than_chunks_and_one_query_row() -> None:
    assert_matches_reference(make_inputs(batch=1, n=3, m=2, s=5, heads=1, dim=3, n_slots=5))
    assert_matches_reference(make_inputs(batch=2, n=2, m=3, s=3, heads=2, dim=4, n_slots=2, lq=1))


def _flash_style_fp32(q, k, v, index, weight, softmax_one=True):
    """The kernels' algorithm in plain fp32 ops: per slot, the scores of the pre-scaled q minus
    their logsumexp, exponentiated, weighted and summed (autograd gives the gradients)."""
    batch, _, _, _, dim = q.shape
    rows = torch.arange(batch)[:, None]
    qs = q * dim**-0.5
    out = torch.zeros_like(q)
    for j in range(index.shape[2]):
        chunk = index[:, :, j].clamp(min=0)
        scores = torch.einsum("bnqhd,bnshd->bnhqs", qs, k[rows, chunk])
        lse = torch.logsumexp(scores, -1, keepdim=True)
        if softmax_one:
            lse = torch.logaddexp(lse, lse.new_zeros(()))
        w = torch.where(index[:, :, j] >= 0, weight[:, :, j], 0)[:, :, None, None, None]
        out = out + torch.einsum("bnhqs,bnshd->bnqhd", (scores - lse).exp() * w, v[rows, chunk])
    return out


@pytest.mark.parametrize("softmax_one", [True, False])
def test_extreme_scores_stay_finite(softmax_one: bool) -> None:
    # Scores in the +-1000s overflow exp without a running max. With k > 0, even query rows
    # have only very negative scores: softmax_1 must give ~0 there (its max includes the zero logit).
    # Such scores are ill-conditioned in fp32: a relative rounding error of 6e-8 in a score of
    # 1000 moves its probability by 6e-5 relative, and dk = dS^T q multiplies that by |q| ~ 300.
    # So the kernel is held to the error of another fp32 implementation of its algorithm (exp of
    # the scores minus their logsumexp, slot by slot) on the same inputs (against the fp64
    # reference), not to a fixed tolerance: at most 4x its error per output and gradient, or
    # 1e-4 absolute where both are tiny. (The PyTorch path takes ATen's fused softmax and its
    # backward, 3-13x more accurate in dk here, so it is no yardstick for this algorithm.)
    q, k, v, index, weight = make_inputs(**SMALL)
    k = k.abs()
    q = q.abs() * 300
    q[:, :, ::2] = -q[:, :, ::2]
    inputs = (q, k, v, index, weight)
    got = outputs_and_grads(gca_triton, *inputs, softmax_one=softmax_one)
    fp32_path = outputs_and_grads(_flash_style_fp32, *inputs, softmax_one=softmax_one)
    exact = [x.double() if x.is_floating_point() else x for x in inputs]
    want = outputs_and_grads(gca_reference, *exact, softmax_one=softmax_one)
    for name, g, p, w in zip(("o", "dq", "dk", "dv", "dweight"), got, fp32_path, want):
        assert torch.isfinite(g).all(), name
        kernel_error = (g.double() - w).abs().max().item()
        path_error = (p.double() - w).abs().max().item()
        print(f"{name}: kernel error {kernel_error:.3g}, fp32 flash-style error {path_error:.3g}")
        assert kernel_error <= max(1e-4, 4 * path_error), (
            f"{name}: {kernel_error:.3g} vs the fp32 flash-style path's {path_error:.3g}"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    # The interpreter's bf16 tl.dot is wrong, so under it bf16 runs in fp32 (inside gca_triton).
    assert_matches_reference(make_inputs(**(LARGE if CUDA else SMALL), dtype=dtype))


def test_no_memory_chunks_gives_zeros() -> None:
    q, k, v, index, weight = make_inputs(batch=1, n=2, m=0, s=4, heads=1, dim=4, n_slots=2)
    index.fill_(-1)
    o, dq, dk, dv, dw = outputs_and_grads(gca_triton, q, k, v, index, weight)
    assert bool((o == 0).all()) and bool((dq == 0).all()) and bool((dw == 0).all())
    assert dk.shape == k.shape and dv.shape == v.shape


def test_dispatch_and_saved_tensors() -> None:
    inputs = make_inputs(**SMALL)
    q, k, v, index, weight = inputs
    torch.testing.assert_close(gca(*inputs, backend="triton"), gca(*inputs, backend="reference"), atol=1e-5, rtol=1e-5)
    sizes: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        gca_triton(q.requires_grad_(True), k, v, index, weight)
    gathered = q.shape[0] * q.shape[1] * index.shape[2] * k.shape[2] * k.shape[3] * k.shape[4]
    lse = q.shape[0] * q.shape[1] * index.shape[2] * q.shape[3] * q.shape[2]
    assert set(sizes) <= {x.numel() for x in inputs} | {lse} and gathered not in sizes


def test_bad_arguments() -> None:
    inputs = make_inputs(**SMALL)
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16"):
        gca_triton(*inputs, block_s=24)
    with pytest.raises(ValueError, match="block_q must be an integer >= 1"):
        gca_triton(*inputs, block_q=0)
    with pytest.raises(TypeError, match="not float64; use backend='torch'"):
        gca_triton(*[x.double() if x.is_floating_point() else x for x in inputs])
