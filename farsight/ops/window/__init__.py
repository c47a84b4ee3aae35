"""Causal sliding-window attention: dense reference, the blockwise O(T * W) path (any device),
the banded CPU kernels and, on GPU, PyTorch's FlexAttention (or SDPA with a dense mask).

Packed rows: `document_ids` [B, Tk] (`farsight.ops.documents`) keep every query to the keys of its
own document, on every backend; a batch whose rows are each one document runs as without them.

Precision (docs/design.md §6): q, k, v share one dtype; under autocast `sliding_window_attention` casts
them to the autocast dtype (`farsight.ops.precision`). ALiBi slopes keep their own precision
(q's dtype or fp32) and are added to fp32 scores (fp64 for fp64 q) on every backend.
"""

from __future__ import annotations

import torch

import farsight.ops.backend as ops_backend
from farsight.errors import BackendUnavailableError, InputError, InputTypeError
from farsight.ops.checks import (
    check_float,
    check_positive_int,
    check_same_dtype_device,
    check_shape,
    check_side_input,
    check_tensor,
)
from farsight.ops.documents import check_document_ids, single_document
from farsight.ops.precision import autocast_inputs
from farsight.ops.window.banded import sliding_window_attention_banded
from farsight.ops.window.blockwise import default_block_size, sliding_window_attention_blockwise
from farsight.ops.window.fused import (
    flex_available,
    sliding_window_attention_flex,
    sliding_window_attention_sdpa,
    window_mask_mod,
)
from farsight.ops.window.reference import reference_mask, sliding_window_attention_reference

__all__ = [
    "BACKENDS",
    "flex_available",
    "resolve_backend",
    "sliding_window_attention",
    "sliding_window_attention_flex",
    "sliding_window_attention_sdpa",
    "sliding_window_attention_blockwise",
    "sliding_window_attention_banded",
    "sliding_window_attention_reference",
    "default_block_size",
    "reference_mask",
    "window_mask_mod",
]

BACKENDS = ("auto", "blockwise", "flex", "sdpa", "reference")
# Below this many queries (decode steps, short prompts) building a FlexAttention block mask costs
# more than the blockwise path saves, so "auto" keeps the blockwise path.
FLEX_MIN_QUERIES = 128


def _flex_or_blockwise(q: torch.Tensor) -> str:
    """The "auto" rule: FlexAttention where its kernels fit the inputs, else "blockwise"."""
    use_flex = (
        q.is_cuda
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q.shape[1] >= FLEX_MIN_QUERIES
        and q.shape[-1] >= 16
        and q.shape[-1] & (q.shape[-1] - 1) == 0  # head dims FlexAttention's kernels are made for
        and flex_available()
    )
    return "flex" if use_flex else "blockwise"


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend `sliding_window_attention` runs for `backend` and inputs like `q`.

    "auto": FlexAttention for CUDA tensors (fp32/fp16/bf16, at least FLEX_MIN_QUERIES queries, a
    power-of-two head dim >= 16) when this torch has it, else "blockwise". Raises for an unknown or unusable backend.
    """
    backend = ops_backend.resolve_backend(backend, q, BACKENDS, auto=_flex_or_blockwise)
    if backend == "flex":
        if not flex_available():
            raise ops_backend.BackendUnavailableError(
                f'backend="flex" needs torch.nn.attention.flex_attention (torch >= 2.5), this is torch '
                f'{torch.__version__}; use backend="blockwise"'
            )
        if not q.is_cuda:
            raise BackendUnavailableError(
                f'backend="flex" needs CUDA tensors (FlexAttention has no backward on CPU), got {q.device}; '
                'use backend="blockwise" or "auto"'
            )
    return backend


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    backend: str = "auto",
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the last `window` positions (the query's own included).

    q [B, Tq, H, d]; k, v [B, Tk, H, d] with Tk >= Tq: the queries are the last Tq positions,
    so a decode step passes its cached keys in front of the new ones. alibi_slopes [H] adds
    -slope * distance; key_padding_mask [B, Tk] (True = real token) hides padding keys.
    document_ids [B, Tk] (integer, one id per document, non-decreasing along a row; the queries'
    ids are the last Tq) packs several documents in a row: a query sees a key only when both
    share a document, on top of the window, ALiBi and padding rules; the window and ALiBi still
    count positions in the row, which inside a document are its own. With every row one
    document (or None) the op runs exactly as without it.

    backend: "auto" (FlexAttention for CUDA tensors with >= FLEX_MIN_QUERIES queries, else
    "blockwise"), "blockwise" (O(T * W), any device; `block_size` is its knob; on CPU without key
    padding or trainable slopes it runs the banded kernels), "flex" (CUDA only), "sdpa" (SDPA
    with a dense [Tq, Tk] mask, any device) or "reference" (dense, tests).

    q, k, v have one dtype; under autocast for q's device type they are cast to the autocast
    dtype, which the output then has. alibi_slopes may be fp32 next to fp16/bf16 q (see
    `check_side_input`). Gradients come back in each input's own dtype.

    Every backend takes document_ids: the banded CPU kernels add one 0/-inf tile of the blocks'
    document mask to each head's scores (a few percent of their time), FlexAttention adds the
    condition to its block mask (key blocks wholly in other documents are skipped), SDPA and the
    reference to their dense mask.
    """
    with autocast_inputs(q, k, v) as (q, k, v):
        return _sliding_window_attention(
            q, k, v, window, alibi_slopes, scale, key_padding_mask, block_size, backend, document_ids
        )


def _sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None,
    scale: float | None,
    key_padding_mask: torch.Tensor | None,
    block_size: int | None,
    backend: str,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sliding_window_attention` once autocast is dealt with: check the inputs, run the backend."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
        check_float(name, x)
    check_same_dtype_device({"q": q, "k": k, "v": v})
    batch, tq, heads, dim = q.shape
    check_shape("k", k, (batch, -1, heads, dim), "batch, keys, heads and head dim of q")
    check_shape("v", v, tuple(k.shape), "same shape as k")
    if k.shape[1] < tq:
        raise InputError(f"k has {k.shape[1]} positions but q has {tq}; queries must be the last positions of the keys")
    check_positive_int("window", window)
    check_positive_int("block_size", block_size, allow_none=True)
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
        check_shape("alibi_slopes", alibi_slopes, (heads,), "one slope per head")
        check_side_input("alibi_slopes", alibi_slopes, q)
    if key_padding_mask is not None:
        check_shape("key_padding_mask", key_padding_mask, (batch, k.shape[1]), "batch x keys")
        if key_padding_mask.dtype != torch.bool:
            raise InputTypeError("key_padding_mask must be a bool tensor (True marks real tokens)")
    if document_ids is not None:
        if isinstance(document_ids, torch.Tensor) and document_ids.device != q.device:
            raise InputError(
                f"document_ids is on {document_ids.device} but q is on {q.device}; move them to one device"
            )
        document_ids = check_document_ids(document_ids, (batch, k.shape[1]))
        if single_document(document_ids):
            document_ids = None  # one document per row: nothing to mask
    backend = resolve_backend(backend, q)
    if tq == 0:
        return q.new_empty(q.shape)
    if backend == "flex":
        return sliding_window_attention_flex(
            q, k, v, window, alibi_slopes, scale, key_padding_mask, document_ids=document_ids
        )
    if backend == "sdpa":
        return sliding_window_attention_sdpa(q, k, v, window, alibi_slopes, scale, key_padding_mask, document_ids)
    if backend == "reference":
        return sliding_window_attention_reference(q, k, v, window, alibi_slopes, scale, key_padding_mask, document_ids)
    # the banded CPU kernels take no key padding and no gradient for the slopes
    trainable_slopes = alibi_slopes is not None and alibi_slopes.requires_grad
    if key_padding_mask is None and q.device.type == "cpu" and not trainable_slopes:
        return sliding_window_attention_banded(q, k, v, window, alibi_slopes, scale, block_size, document_ids)
    return sliding_window_attention_blockwise(
        q, k, v, window, alibi_slopes, scale, key_padding_mask, block_size, document_ids
    )
