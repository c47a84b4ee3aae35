"""Mixed precision of the ops (docs/design.md §6): under bf16/fp16 autocast, with bf16 inputs next to fp32
side inputs (GCA weights, ALiBi slopes) and in pure bf16, every backend's output and every input
gradient agree with the fp32 op within the tolerance of the low dtype (relative RMS error),
outputs have the autocast dtype, gradients their input's dtype, everything finite.

Forward and backward both run inside the autocast region, which also checks that the autograd
Functions' backward runs with autocast off (custom_bwd). The Triton kernels run under the CPU
interpreter without a GPU (TRITON_INTERPRET is set before their first import, as in
tests/ops/test_gca_triton.py); there bf16 is computed in fp32, and the shapes stay tiny.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from farsight.ops.castle import (  # noqa: E402
    castle_attention,
    castle_decode,
    castle_prefill,
    castle_recurrent,
)
from farsight.ops.castle import inference as castle_inference  # noqa: E402
from farsight.ops.gca import gca  # noqa: E402
from farsight.ops.window import sliding_window_attention, sliding_window_attention_flex  # noqa: E402
from tests.tolerance import RMS_RATIO, assert_close_rms  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
LOW = [torch.bfloat16, torch.float16]
NEEDS_TRITON = [pytest.mark.triton, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")]
TRITON = pytest.param("triton", marks=NEEDS_TRITON)


def autocast(dtype: torch.dtype | None):
    return contextlib.nullcontext() if dtype is None else torch.autocast(DEVICE, dtype=dtype)


def run(fn, inputs: list, autocast_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn(*leaves) and the gradients of <o, fixed random cotangent> for every floating leaf,
    forward and backward under autocast when `autocast_dtype` is given."""
    leaves = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    with autocast(autocast_dtype):
        out = fn(*leaves)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        (out.float() * cotangent).sum().backward()
    return out.detach(), [x.grad for x in leaves if x.is_floating_point()]


def assert_matches_fp32(fn, inputs: list, names: tuple[str, ...], out_dtype, ratio, autocast_dtype=None) -> None:
    """`fn` on `inputs` (optionally under autocast) against `fn` on the fp32 values of the same inputs."""
    exact = [x.float() if x.is_floating_point() else x for x in inputs]
    want_out, want_grads = run(fn, exact)
    got_out, got_grads = run(fn, inputs, autocast_dtype)
    assert got_out.dtype == out_dtype
    assert_close_rms("o", want_out, got_out, ratio)
    floating = [x for x in inputs if x.is_floating_point()]
    assert len(got_grads) == len(names)
    for name, x, want, got in zip(names, floating, want_grads, got_grads):
        assert got.dtype == x.dtype, f"{name}: gradient dtype {got.dtype}, input dtype {x.dtype}"
        assert_close_rms(f"d{name}", want, got, ratio)


# --- GCA --------------------------------------------------------------------------------------

GCA_NAMES = ("q", "k", "v", "weight")
GCA_BACKENDS = ["torch", "reference", TRITON]


def gca_inputs(memory_chunks: int = 4) -> list[torch.Tensor]:
    """Odd sizes (Lq=5, S=7, H=3, d=6): chunk 0 retrieved twice by one query chunk, empty slots,
    and a query chunk that retrieved nothing; with memory_chunks=0 every slot is empty."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 3, 6, generator=gen)
    k, v = (torch.randn(2, memory_chunks, 7, 3, 6, generator=gen) for _ in range(2))
    index = torch.tensor([[[0, 0, 3], [2, -1, 1], [-1, -1, -1]], [[1, 3, -1], [0, 2, 2], [3, -1, 0]]])
    if memory_chunks == 0:
        index = torch.full_like(index, -1)
    weight = torch.randn(2, 3, 3, generator=gen).softmax(dim=-1)
    return [x.to(DEVICE) for x in (q, k, v, index, weight)]


def _gca(backend: str):
    return lambda q, k, v, index, weight: gca(q, k, v, index, weight, backend=backend)


@pytest.mark.parametrize("backend", GCA_BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
def test_gca_under_autocast(backend, dtype) -> None:
    assert_matches_fp32(_gca(backend), gca_inputs(), GCA_NAMES, dtype, RMS_RATIO[dtype], autocast_dtype=dtype)


@pytest.mark.parametrize("backend", GCA_BACKENDS)
@pytest.mark.parametrize("use_autocast", [False, True])
def test_gca_bf16_with_fp32_weight(backend, use_autocast) -> None:
    q, k, v, index, weight = gca_inputs()
    inputs = [q.bfloat16(), k.bfloat16(), v.bfloat16(), index, weight]
    dtype = torch.bfloat16
    assert_matches_fp32(_gca(backend), inputs, GCA_NAMES, dtype, RMS_RATIO[dtype], dtype if use_autocast else None)


@pytest.mark.parametrize("backend", GCA_BACKENDS)
def test_gca_pure_bf16(backend) -> None:
    inputs = [x.bfloat16() if x.is_floating_point() else x for x in gca_inputs()]
    assert_matches_fp32(_gca(backend), inputs, GCA_NAMES, torch.bfloat16, RMS_RATIO[torch.bfloat16])


@pytest.mark.parametrize("backend", GCA_BACKENDS)
def test_gca_empty_retrieval_under_autocast(backend) -> None:
    out, grads = run(_gca(backend), gca_inputs(memory_chunks=0), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and not out.any()
    for name, grad in zip(GCA_NAMES, grads):
        assert grad.dtype == torch.float32 and not grad.any(), name


def test_gca_fp32_weight_with_fp64_inputs() -> None:
    # Fusion weights come from an fp32 softmax in every model dtype; fp64 models use them exactly.
    q, k, v, index, weight = (x.double() if x.is_floating_point() else x for x in gca_inputs())
    want = gca(q, k, v, index, weight.float().double(), backend="torch")
    assert torch.equal(gca(q, k, v, index, weight.float(), backend="torch"), want)


def test_gca_mixed_qkv_dtypes_need_autocast() -> None:
    q, k, v, index, weight = gca_inputs()
    # What autocast hands over: q from a linear (bf16), k, v from a norm or a cache (fp32).
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert gca(q.bfloat16(), k, v, index, weight).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="k has dtype torch.float32 but q has torch.bfloat16; cast them to one dtype"):
        gca(q.bfloat16(), k, v, index, weight)
    with pytest.raises(TypeError, match=r"weight has dtype torch.float16 but q has torch.bfloat16; cast weight to"):
        gca(q.bfloat16(), k.bfloat16(), v.bfloat16(), index, weight.half())


# --- CASTLE -----------------------------------------------------------------------------------

CASTLE_NAMES = ("qu", "ku", "vu", "qc", "kc", "vc")


def castle_inputs(steps: int = 19, heads: int = 2, dim: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, steps, heads, dim, generator=gen).to(DEVICE) for _ in CASTLE_NAMES]


def _castle(backend: str, window: int | None):
    # block_size=8 gives the torch path several key blocks and a partial last one at T=19.
    return lambda *x: castle_attention(*x, window=window, block_size=8, backend=backend)


@pytest.mark.parametrize(
    "backend,window",
    [
        ("torch", None),
        ("torch", 1),
        ("torch", 5),
        ("reference", 5),
        pytest.param("triton", None, marks=NEEDS_TRITON),
        pytest.param("triton", 5, marks=NEEDS_TRITON),
    ],
)
@pytest.mark.parametrize("dtype", LOW)
def test_castle_under_autocast(backend, window, dtype) -> None:
    assert_matches_fp32(
        _castle(backend, window), castle_inputs(), CASTLE_NAMES, dtype, RMS_RATIO[dtype], autocast_dtype=dtype
    )


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
@pytest.mark.parametrize("precision", ["autocast", "pure"])
def test_castle_backward_in_passes_low_precision(precision, monkeypatch) -> None:
    # The two-pass Triton backward (FARSIGHT_CASTLE_BACKWARD=passes) under bf16 autocast and in pure bf16.
    import farsight.ops.castle.triton as castle_triton

    monkeypatch.setattr(castle_triton, "BACKWARD", "passes")
    bf16 = torch.bfloat16
    inputs = castle_inputs() if precision == "autocast" else [x.bfloat16() for x in castle_inputs()]
    autocast = {"autocast_dtype": bf16} if precision == "autocast" else {}
    assert_matches_fp32(_castle("triton", 5), inputs, CASTLE_NAMES, bf16, RMS_RATIO[bf16], **autocast)


def test_castle_recurrent_under_autocast() -> None:
    bf16 = torch.bfloat16
    fn = functools.partial(castle_recurrent, window=4)
    assert_matches_fp32(fn, castle_inputs(steps=9), CASTLE_NAMES, bf16, RMS_RATIO[bf16], autocast_dtype=bf16)


@pytest.mark.parametrize("backend", ["torch", "reference", TRITON])
def test_castle_pure_bf16(backend) -> None:
    inputs = [x.bfloat16() for x in castle_inputs()]
    assert_matches_fp32(_castle(backend, 5), inputs, CASTLE_NAMES, torch.bfloat16, RMS_RATIO[torch.bfloat16])


def test_castle_mixed_dtypes_need_autocast() -> None:
    # The lookahead projections in bf16, the causal ones in fp32: accepted under autocast only.
    inputs = castle_inputs()
    mixed = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]
    bf16 = torch.bfloat16
    assert_matches_fp32(_castle("torch", 5), mixed, CASTLE_NAMES, bf16, RMS_RATIO[bf16], autocast_dtype=bf16)
    with pytest.raises(TypeError, match="qc has dtype torch.float32 but qu has torch.bfloat16"):
        castle_attention(*mixed)


@pytest.mark.parametrize("backend", ["torch", TRITON])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("held_back", [False, True])
def test_castle_prefill_and_decode_under_autocast(backend, dtype, held_back, monkeypatch) -> None:
    if held_back:  # every step holds its update of U back (by default only from 2048 rows on)
        monkeypatch.setattr(castle_inference, "HOLD_BACK_FROM_ROWS", 1)
    inputs = castle_inputs(steps=13)
    want = castle_attention(*inputs, window=3)
    with torch.autocast(DEVICE, dtype=dtype):
        out, cache = castle_prefill(*(x[:, :9] for x in inputs), window=3, backend=backend)
        outs = [out]
        for t in range(9, 13):
            step, cache = castle_decode(*(x[:, t : t + 1] for x in inputs), cache)
            outs.append(step)
    got = torch.cat(outs, dim=1)
    assert got.dtype == dtype and cache.input_dtype == dtype
    # The cache keeps all of its rows in fp32: U is updated in place at every step.
    assert all(x.dtype == torch.float32 for x in cache.tensors())
    assert_close_rms("o", want, got, RMS_RATIO[dtype])
    with pytest.raises(TypeError, match="the cache was built for"):
        castle_decode(*(x[:, :1] for x in inputs), cache)


# --- sliding-window attention -----------------------------------------------------------------

WINDOW_BACKENDS = ["blockwise", "sdpa", "reference"]
WINDOW = 5


def window_inputs(dtype=torch.float32, slope_dtype=torch.float32) -> list[torch.Tensor]:
    """13 queries after 6 cached keys (Tk = 19), H=3, d=6, and fp32 ALiBi slopes."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 13, 3, 6, generator=gen)
    k, v = (torch.randn(2, 19, 3, 6, generator=gen) for _ in range(2))
    slopes = torch.rand(3, generator=gen)
    return [q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), slopes.to(DEVICE, slope_dtype)]


def _window(backend: str, key_padding_mask: torch.Tensor | None = None):
    return lambda q, k, v, slopes: sliding_window_attention(
        q, k, v, WINDOW, slopes, key_padding_mask=key_padding_mask, backend=backend
    )


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
def test_window_under_autocast(backend, dtype) -> None:
    fn = _window(backend)
    assert_matches_fp32(fn, window_inputs(), ("q", "k", "v", "slopes"), dtype, RMS_RATIO[dtype], autocast_dtype=dtype)


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@pytest.mark.parametrize("use_autocast", [False, True])
def test_window_bf16_with_fp32_slopes(backend, use_autocast) -> None:
    # Batch row 1 hides every key: each query then attends to itself only (no all -inf rows).
    padding = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    padding[1] = False
    inputs = window_inputs(torch.bfloat16)
    dtype = torch.bfloat16
    fn = _window(backend, padding)
    assert_matches_fp32(fn, inputs, ("q", "k", "v", "slopes"), dtype, RMS_RATIO[dtype], dtype if use_autocast else None)


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_window_pure_bf16(backend) -> None:
    inputs = window_inputs(torch.bfloat16, torch.bfloat16)
    assert_matches_fp32(_window(backend), inputs, ("q", "k", "v", "slopes"), torch.bfloat16, RMS_RATIO[torch.bfloat16])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", LOW)
def test_window_flex_low_precision_with_fp32_slopes(dtype) -> None:
    # FlexAttention is dispatched for CUDA only (no CPU backward): on CPU its forward runs eagerly.
    q, k, v, slopes = window_inputs()
    q, k, v = (x[..., :4].contiguous() for x in (q, k, v))  # eager FlexAttention wants a power-of-two d
    want = sliding_window_attention(q, k, v, WINDOW, slopes, backend="reference")
    for block_size in (None, 16):  # the default tile, and one smaller than the inputs
        low = (x.to(dtype) for x in (q, k, v))
        got = sliding_window_attention_flex(*low, WINDOW, slopes, compile=False, block_size=block_size)
        assert got.dtype == dtype
        assert_close_rms("o", want, got, RMS_RATIO[dtype])


def test_window_mixed_dtypes_need_autocast() -> None:
    q, k, v, slopes = window_inputs()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert sliding_window_attention(q.bfloat16(), k, v, WINDOW, slopes).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="k has dtype torch.float32 but q has torch.bfloat16"):
        sliding_window_attention(q.bfloat16(), k, v, WINDOW, slopes)
    with pytest.raises(TypeError, match="alibi_slopes has dtype torch.float64 but q has torch.bfloat16"):
        sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), WINDOW, slopes.double())


# --- what autocast leaves alone ---------------------------------------------------------------


def test_fp64_inputs_are_not_cast() -> None:
    # Autocast never casts fp64, and neither do the ops under it: the result is the fp64 one, exactly.
    q, k, v, slopes = (x.double() for x in window_inputs())
    want = sliding_window_attention(q, k, v, WINDOW, slopes)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = sliding_window_attention(q, k, v, WINDOW, slopes)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_meta_tensors_still_run() -> None:
    # Shape inference on the meta device: it has no autocast, so nothing is cast or decorated.
    inputs = [torch.empty(1, 9, 2, 8, device="meta", requires_grad=True) for _ in CASTLE_NAMES]
    assert castle_attention(*inputs, backend="torch").shape == (1, 9, 2, 8)
    q, k, v = inputs[:3]
    assert sliding_window_attention(q, k, v, WINDOW).device.type == "meta"
