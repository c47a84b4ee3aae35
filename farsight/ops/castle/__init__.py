"""CASTLE: causal attention with lookahead keys (and CASTLE-SWL, its sliding-window variant).

All six inputs (qu, ku, vu: lookahead query/key/value; qc, kc, vc: causal query/key/value) are
[B, T, H, d]. `castle_attention` is the training path (O(T^2 d) time, O(T d) memory, custom
backward); `castle_prefill` / `castle_decode` with a `CastleCache` are the inference path;
`castle_recurrent` and `castle_parallel_reference` are slow ground truths for tests.

Backends of `castle_attention` / `castle_prefill`: "torch" (`farsight.ops.castle.blockwise`,
any device), "triton" (`farsight.ops.castle.triton`; CUDA, or CPU with TRITON_INTERPRET=1)
and, for `castle_attention` only, "reference" (`castle_parallel_reference`, O(T^3)). "auto"
picks Triton for CUDA tensors when triton is installed, else "torch". Triton is imported only
when its backend is used.
"""

from __future__ import annotations

import torch

from farsight.ops.castle import blockwise
from farsight.ops.castle.blockwise import DEFAULT_BLOCK_SIZE, CastleCache, castle_decode
from farsight.ops.castle.reference import (
    INPUT_NAMES,
    castle_parallel_reference,
    castle_recurrent,
    check_castle_inputs,
)
from farsight.ops.checks import check_positive_int, compute_dtype
from farsight.ops.gca import triton_available

__all__ = [
    "BACKENDS",
    "CastleCache",
    "castle_attention",
    "castle_attention_triton",
    "castle_decode",
    "castle_parallel_reference",
    "castle_prefill",
    "castle_recurrent",
]

BACKENDS = ("auto", "torch", "triton", "reference")


def castle_attention_triton(*args, **kwargs) -> torch.Tensor:
    """Triton kernels; see `farsight.ops.castle.triton.castle_attention_triton` (imported on first use)."""
    from farsight.ops.castle.triton import castle_attention_triton as kernel

    return kernel(*args, **kwargs)


def _resolve_backend(backend: str, x: torch.Tensor, allowed: tuple[str, ...]) -> str:
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    if backend == "auto":
        use_triton = x.is_cuda and x.dtype != torch.float64 and triton_available()
        return "triton" if use_triton else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError('backend="triton" needs the triton package; install it or use backend="torch"')
    return backend


def castle_attention(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    backend: str = "auto",
) -> torch.Tensor:
    """CASTLE (window=None) or CASTLE-SWL (window=W >= 1) attention for training.

    All six inputs are [B, T, H, d] with one dtype and device; returns o [B, T, H, d] in the
    input dtype, differentiable in all six. See `farsight.ops.castle.blockwise.castle_attention`
    for the torch path (its `block_size` is a CPU speed knob, unused by the other backends).
    backend: "auto" (Triton for CUDA tensors when installed, else "torch"), "torch", "triton"
    (fp32/fp16/bf16; CUDA, or CPU with TRITON_INTERPRET=1) or "reference" (O(T^3), tests only).
    """
    named = dict(zip(INPUT_NAMES, (qu, ku, vu, qc, kc, vc)))
    scale = check_castle_inputs(named, window, scale)
    check_positive_int("block_size", block_size)
    backend = _resolve_backend(backend, qu, BACKENDS)
    if backend == "torch":
        return blockwise.castle_attention(qu, ku, vu, qc, kc, vc, window, scale, block_size)
    if backend == "reference":
        return castle_parallel_reference(qu, ku, vu, qc, kc, vc, window, scale)
    return castle_attention_triton(qu, ku, vu, qc, kc, vc, window, scale)


def castle_prefill(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    layer: object = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, CastleCache]:
    """Process a prompt (Algorithm 4): returns (o [B, T, H, d], the UQ-KV cache after T tokens).

    See `farsight.ops.castle.blockwise.castle_prefill`. backend: "auto", "torch" or "triton"
    (the lookahead keys U come out of the Triton forward's own D accumulation).
    """
    named = dict(zip(INPUT_NAMES, (qu, ku, vu, qc, kc, vc)))
    resolved_scale = check_castle_inputs(named, window, scale)
    check_positive_int("block_size", block_size)
    backend = _resolve_backend(backend, qu, ("auto", "torch", "triton"))
    if backend == "torch":
        return blockwise.castle_prefill(qu, ku, vu, qc, kc, vc, window, scale, block_size, layer)
    scale = resolved_scale
    from farsight.ops.castle.triton import castle_prefill_triton

    out, u = castle_prefill_triton(qu, ku, vu, qc, kc, vc, window, scale)
    dtype = compute_dtype(qu.dtype)
    with torch.no_grad():
        rest = [
            x.transpose(1, 2).to(dtype=dtype, memory_format=torch.contiguous_format, copy=True) for x in (qu, kc, vc)
        ]
    cache = CastleCache(u, *rest, length=qu.shape[1], window=window, scale=scale, input_dtype=qu.dtype, layer=layer)
    return out, cache
