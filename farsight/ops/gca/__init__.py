"""Grouped cross-attention (GCA): each query chunk attends to each of its K retrieved memory
chunks separately and fuses the K results with the retrieval weights (docs/design.md §2.4).

Backends: `gca_reference` (gather + einsum, the readable definition), `gca_recompute` (PyTorch,
any device, backward without gathered copies) and `gca_triton` (fused kernels that read the
chunks through the index; CUDA, or CPU under TRITON_INTERPRET=1). `gca` checks the inputs and
picks one. Triton is imported only when its backend is used.

Precision (docs/design.md §6): q, k, v share one dtype (fp32, fp16, bf16 or fp64); under autocast `gca`
casts them to the autocast dtype (`farsight.ops.precision`). `weight` keeps its own precision
(q's dtype or fp32): the K per-chunk results are fused with fp32 weights (fp64 for fp64 q).
"""

from __future__ import annotations

import sys
import types

import torch

from farsight.errors import InputError, InputTypeError
from farsight.ops.backend import resolve_backend
from farsight.ops.checks import check_float, check_same_dtype_device, check_shape, check_side_input, check_tensor
from farsight.ops.gca.recompute import gca_recompute
from farsight.ops.gca.reference import gca_reference
from farsight.ops.precision import autocast_inputs

__all__ = ["gca", "gca_recompute", "gca_reference", "gca_triton", "check_gca_inputs", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton", "reference")


def gca_triton(*args, **kwargs) -> torch.Tensor:
    """Fused Triton kernels; see `farsight.ops.gca.triton.gca_triton` (imported on first use)."""
    from farsight.ops.gca.triton import gca_triton as kernel

    return kernel(*args, **kwargs)


def check_gca_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError/TypeError naming the bad argument and the fix; see `gca` for shapes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=5)
    check_tensor("index", index, ndim=3)
    check_tensor("weight", weight, ndim=3)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
    check_same_dtype_device({"q": q, "k": k, "v": v})
    check_side_input("weight", weight, q)
    if index.device != q.device:
        raise InputError(f"index is on {index.device} but q is on {q.device}; move them to one device")
    if index.dtype != torch.long:
        raise InputTypeError(f"index must be a torch.long tensor of chunk ids, got {index.dtype}; use index.long()")
    batch, n, lq, heads, dim = q.shape
    check_shape("k", k, (batch, -1, -1, heads, dim), "[B, m, S, H, d] with B, H, d of q")
    check_shape("v", v, tuple(k.shape), "same shape as k")
    check_shape("index", index, (batch, n, -1), "[B, n, K] with B, n of q")
    check_shape("weight", weight, tuple(index.shape), "same shape as index")
    if lq < 1 or k.shape[2] < 1 or dim < 1:
        raise InputError(
            f"q rows per chunk (Lq={lq}), k rows per chunk (S={k.shape[2]}) and head dim (d={dim}) must all be >= 1"
        )
    if index.shape[2] < 1:
        raise InputError("index must hold K >= 1 slots per query chunk; use -1 for slots with no chunk")
    if key_mask is not None:
        check_tensor("key_mask", key_mask, ndim=4)
        if key_mask.dtype != torch.bool:
            raise InputTypeError(f"key_mask must be a bool tensor (True marks real keys), got {key_mask.dtype}")
        if key_mask.device != q.device:
            raise InputError(f"key_mask is on {key_mask.device} but q is on {q.device}; move them to one device")
        check_shape(
            "key_mask",
            key_mask,
            (*index.shape, k.shape[2]),
            "[B, n, K, S]: per retrieval slot, which of the chunk's S keys are real",
        )
    m = k.shape[1]
    # A data-dependent check: skipped inside torch.compile, where it would split the graph (the
    # compiled DRT blocks take their indices from the model's own retrieval).
    if index.numel() and not torch.compiler.is_compiling() and bool(((index < -1) | (index >= m)).any()):
        lo, hi = int(index.min()), int(index.max())
        raise InputError(
            f"index values must lie in [-1, {m}) (-1 = empty slot, k holds m={m} chunks), "
            f"got values in [{lo}, {hi}]; replace missing chunks by -1"
        )


def gca(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool = True,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped cross-attention.

    q [B, n, Lq, H, d]: n query chunks of Lq rows (S+1 slots in DRT); k, v [B, m, S, H, d]: m
    memory chunks of S rows; index [B, n, K] long in [-1, m) (-1 = empty slot); weight [B, n, K].
    Returns o [B, n, Lq, H, d] with

        o[b, t] = sum_{k: index[b,t,k] >= 0} weight[b,t,k] * softmax_x(scale q[b,t] K_c^T) V_c,

    c = index[b, t, k], per head over the S rows of chunk c, softmax_x = softmax off by one
    (exp(x_i) / (1 + sum_j exp(x_j))) when `softmax_one`, else softmax; scale defaults to
    1/sqrt(d). Differentiable in q, k, v and weight; empty slots add exactly zero and get a zero
    weight gradient.

    key_mask [B, n, K, S] bool (True = real key), optional: the keys of retrieval slot k that
    query chunk t may attend to (DRT's left padding makes the first chunk of a prompt part
    padding). Masked keys leave every softmax; a slot with no real key adds zero. Every backend
    takes it.

    q, k, v have one dtype; weight has q's dtype or fp32 and is used in fp32 (fp64 for fp64
    q). Under autocast for q's device type, q, k and v are cast to the autocast dtype first
    and the output has that dtype. Gradients come back in each input's own dtype. Softmax
    statistics and accumulation are fp32 (fp64 for fp64 inputs) on every backend; the Triton
    kernels keep the scores in fp32 too, while the "torch" path's fp16/bf16 matmuls round
    their results (the scores among them) to the input dtype once.

    backend: "auto" (Triton for CUDA tensors when installed, else "torch"), "torch"
    (`gca_recompute`), "triton" (`gca_triton`; CUDA, or CPU with TRITON_INTERPRET=1) or
    "reference" (`gca_reference`).
    """
    with autocast_inputs(q, k, v) as (q, k, v):
        check_gca_inputs(q, k, v, index, weight, key_mask)
        if scale is not None and not isinstance(scale, (int, float)):
            raise InputTypeError(f"scale must be a float or None (for 1/sqrt(d)), got {type(scale).__name__}")
        backend = resolve_backend(backend, q, BACKENDS)
        if backend == "torch":
            return gca_recompute(q, k, v, index, weight, softmax_one, scale, key_mask)
        if backend == "reference":
            return gca_reference(q, k, v, index, weight, softmax_one, scale, key_mask)
        return gca_triton(q, k, v, index, weight, softmax_one, scale, key_mask)


class _CallablePackage(types.ModuleType):
    """This package, callable as the op: `from farsight.ops import gca` gives the package (so
    `farsight.ops.gca.triton` and `import farsight.ops.gca.reference` keep working) and
    `gca(q, k, v, index, weight)` calls `farsight.ops.gca.gca`."""

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return gca(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
