"""CASTLE: causal attention with lookahead keys (and CASTLE-SWL, its sliding-window variant).

All six inputs (qu, ku, vu: lookahead query/key/value; qc, kc, vc: causal query/key/value) are
[B, T, H, d]. `castle_attention` is the training path (O(T^2 d) time, O(T d) memory, custom
backward); `castle_prefill` / `castle_decode` with a `CastleCache` are the inference path
(`farsight.ops.castle.inference`); `castle_recurrent` and `castle_parallel_reference` are slow
ground truths for tests. These entry points check their arguments (shapes, dtypes, devices,
window, scale and, for decoding, the cache) once and resolve `scale`; the modules behind them
assume valid inputs.

Backends of `castle_attention` / `castle_prefill`: "torch" (`farsight.ops.castle.blockwise`,
any device), "triton" (`farsight.ops.castle.triton`; CUDA, or CPU with TRITON_INTERPRET=1)
and, for `castle_attention` only, "reference" (`castle_parallel_reference`, O(T^3)). "auto"
picks Triton for CUDA tensors when triton is installed, else "torch" (`farsight.ops.backend`).
Triton is imported only when its backend is used.

Precision (docs/design.md §6): the six inputs share one dtype (fp32, fp16, bf16 or fp64). Under autocast
every entry point here casts them to the autocast dtype and runs with autocast off
(`farsight.ops.precision`), so outputs come back in the autocast dtype and gradients in each
input's own dtype. Inside, the torch paths compute in fp32 (fp64 for fp64) and the Triton
kernels take fp16/bf16 operands with fp32 scores, softmax statistics, lookahead sums D / U and
accumulators. The decode cache keeps its rows in fp32 (fp64 for fp64; see `CastleCache`).

Packed rows (`farsight.ops.documents`): `castle_attention` and the two references take
`document_ids` [B, T], and query t then attends key s only when doc(s) == doc(t). That mask on
the [query, key] score (where S^U enters it and on the causal score before the softmax) is the
whole change: the lookahead sums need none of their own. S^U[t, s] = scale * sum_{s < c <= t}
P[s, c] (qc_t . vu_c) is only read where doc(s) == doc(t), and because a document's tokens are
consecutive, every c with s < c <= t then lies in that same document; so no lookahead sum that
reaches the softmax crosses a boundary. (Where the blockwise and Triton paths still form S^U
for a pair of different documents, in a block they do not skip, it is discarded with its score
and the gradient through it is exactly 0.) A batch whose rows each hold one document
(`single_document`) runs exactly the path without documents. Decoding (`castle_prefill` /
`castle_decode`) takes no documents.
"""

from __future__ import annotations

import math

import torch

from farsight.errors import InputError, InputTypeError
from farsight.ops.backend import resolve_backend
from farsight.ops.castle import blockwise, inference, reference
from farsight.ops.castle.blockwise import DEFAULT_BLOCK_SIZE
from farsight.ops.castle.inference import CastleCache
from farsight.ops.checks import check_float, check_positive_int, check_same_dtype_device, check_shape, check_tensor
from farsight.ops.documents import check_document_ids, single_document
from farsight.ops.precision import autocast_inputs

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
PREFILL_BACKENDS = ("auto", "torch", "triton")
INPUT_NAMES = ("qu", "ku", "vu", "qc", "kc", "vc")


def check_castle_inputs(tensors: dict[str, torch.Tensor], window: object, scale: object) -> float:
    """Validate the six [B, T, H, d] inputs, `window` and `scale`; return the resolved scale.

    `tensors` maps the argument names (qu, ku, vu, qc, kc, vc) to the tensors, so every error
    names the offending argument. Nothing is broadcast: all six must have qu's exact shape.
    """
    for name, x in tensors.items():
        check_tensor(name, x, ndim=4)
        check_float(name, x)
    check_same_dtype_device(tensors)
    first_name, first = next(iter(tensors.items()))
    for name, x in tensors.items():
        check_shape(name, x, tuple(first.shape), f"[B, T, H, d], the same as {first_name}; nothing is broadcast")
    if first.shape[-1] < 1:
        raise InputError(f"head dimension d must be >= 1, got {first_name} with shape {list(first.shape)}")
    check_positive_int("window", window, allow_none=True)
    if scale is None:
        return 1.0 / math.sqrt(first.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale must be a finite float or None (for 1/sqrt(d)), got {scale!r}")
    return float(scale)


def check_castle_documents(document_ids: object, qu: torch.Tensor) -> torch.Tensor | None:
    """Validate `document_ids` [B, T] for inputs like qu (None passes); return them as long on
    qu's device, or None when every row holds one document (masking would change nothing)."""
    if document_ids is None:
        return None
    if isinstance(document_ids, torch.Tensor) and document_ids.device != qu.device:
        raise InputError(f"document_ids is on {document_ids.device} but qu is on {qu.device}; move them to one device")
    document_ids = check_document_ids(document_ids, tuple(qu.shape[:2]))
    return None if single_document(document_ids) else document_ids


class _Unset:
    def __repr__(self) -> str:
        return "<taken from the cache>"


_FROM_CACHE = _Unset()


def _check_decode(
    named: dict[str, torch.Tensor],
    cache: CastleCache,
    window: object,
    scale: object,
    layer: object,
    position: int | None,
) -> None:
    """Validate one decoding step's inputs against the cache and the optional expectations."""
    if not isinstance(cache, CastleCache):
        raise InputTypeError(
            f"cache must be a CastleCache (from castle_prefill or CastleCache.empty), got {type(cache).__name__}"
        )
    if layer is not None and cache.layer != layer:
        raise InputError(
            f"cache belongs to layer {cache.layer!r} but castle_decode was called for layer {layer!r}; "
            "pass this layer's own cache"
        )
    resolved = check_castle_inputs(named, cache.window, None if isinstance(scale, _Unset) else scale)
    qu = named["qu"]
    if qu.shape[1] != 1:
        raise InputError(
            f"castle_decode takes exactly one new token per call (inputs [B, 1, H, d]), got qu with "
            f"{qu.shape[1]} time steps; use castle_prefill for a prompt"
        )
    if not isinstance(window, _Unset):
        check_positive_int("window", window, allow_none=True)
        if window != cache.window:
            raise InputError(
                f"cache was built with window={cache.window!r} but window={window!r} was requested; "
                "build the cache with the same window (castle_prefill(..., window=...))"
            )
    if not isinstance(scale, _Unset) and resolved != cache.scale:
        raise InputError(
            f"cache was built with scale={cache.scale!r} but scale={resolved!r} was requested; "
            "use the same scale for prefill and decode"
        )
    expected = (cache.batch, 1, cache.heads, cache.head_dim)
    for name, x in named.items():
        if tuple(x.shape) != expected:
            raise InputError(
                f"{name} must have shape {list(expected)} (one token with the cache's batch, heads and head dim), "
                f"got {list(x.shape)}"
            )
    if qu.dtype != cache.input_dtype:
        raise InputTypeError(
            f"inputs have dtype {qu.dtype} but the cache was built for {cache.input_dtype}; decode in the dtype "
            "(or under the autocast setting) the cache was built with"
        )
    if qu.device != cache.device:
        raise InputError(f"inputs are on {qu.device} but the cache is on {cache.device}; move them to one device")
    if position is not None and position != cache.length:
        raise InputError(
            f"cache holds {cache.length} tokens, so the new token is at position {cache.length}, but "
            f"position={position} was passed; the cache is out of sync with the sequence"
        )


def castle_attention_triton(*args, **kwargs) -> torch.Tensor:
    """Triton kernels; see `farsight.ops.castle.triton.castle_attention_triton` (imported on first use)."""
    from farsight.ops.castle.triton import castle_attention_triton as kernel

    return kernel(*args, **kwargs)


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
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """CASTLE (window=None) or CASTLE-SWL (window=W >= 1) attention for training.

    All six inputs are [B, T, H, d] with one dtype and device (under autocast: any floating
    dtypes, cast to the autocast dtype); returns o [B, T, H, d] in that dtype, differentiable in
    all six; scale defaults to 1/sqrt(d). See
    `farsight.ops.castle.blockwise.castle_attention` for the torch path (its `block_size` is a
    CPU speed knob, unused by the other backends). backend: "auto" (Triton for CUDA tensors when
    installed, else "torch"), "torch", "triton" (fp32/fp16/bf16; CUDA, or CPU with
    TRITON_INTERPRET=1) or "reference" (O(T^3), tests only).

    `document_ids` [B, T] (integer, non-decreasing along each row; `farsight.ops.documents`)
    packs several documents into a row: a token attends, and its lookahead sums reach, only
    tokens of its own document, on every backend; each document's outputs and gradients are
    those of the document run on its own.
    """
    with autocast_inputs(qu, ku, vu, qc, kc, vc) as inputs:
        scale = check_castle_inputs(dict(zip(INPUT_NAMES, inputs)), window, scale)
        check_positive_int("block_size", block_size)
        backend = resolve_backend(backend, inputs[0], BACKENDS)
        document_ids = check_castle_documents(document_ids, inputs[0])
        if backend == "torch":
            return blockwise.castle_attention(*inputs, window, scale, block_size, document_ids)
        if backend == "reference":
            return reference.castle_parallel_reference(*inputs, window, scale, document_ids)
        return castle_attention_triton(*inputs, window, scale, document_ids=document_ids)


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

    o equals castle_attention's output; the lookahead keys U come out of the same forward pass.
    A prompt of length 0 is allowed and gives an empty cache (as does CastleCache.empty). No
    autograd graph is built. `layer` tags the cache for castle_decode. backend: "auto", "torch"
    (blockwise; `block_size` is its knob) or "triton". Under autocast the inputs are cast to
    the autocast dtype, which becomes the cache's `input_dtype` (and o's dtype).
    """
    with autocast_inputs(qu, ku, vu, qc, kc, vc) as inputs:
        scale = check_castle_inputs(dict(zip(INPUT_NAMES, inputs)), window, scale)
        check_positive_int("block_size", block_size)
        backend = resolve_backend(backend, inputs[0], PREFILL_BACKENDS)
        return inference.prefill(*inputs, window, scale, block_size, layer, backend)


def castle_decode(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    cache: CastleCache,
    *,
    window: object = _FROM_CACHE,
    scale: object = _FROM_CACHE,
    layer: object = None,
    position: int | None = None,
) -> tuple[torch.Tensor, CastleCache]:
    """One decoding step (Algorithm 5): inputs [B, 1, H, d] -> (o [B, 1, H, d], cache).

    The cache is updated in place (and returned); see `farsight.ops.castle.inference.decode`.
    O(t d) per step with t tokens cached. The optional `window`, `scale`, `layer` and
    `position` (= t) are checked against the cache to catch a cache that belongs to another
    configuration, layer or step. No autograd graph is built. Under autocast the inputs are cast
    to the autocast dtype before they are checked against the cache's `input_dtype`.
    """
    with autocast_inputs(qu, ku, vu, qc, kc, vc) as inputs:
        _check_decode(dict(zip(INPUT_NAMES, inputs)), cache, window, scale, layer, position)
        return inference.decode(cache, *inputs), cache


def castle_recurrent(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Literal recurrent CASTLE (O(T^3 d); T <= ~130): see `farsight.ops.castle.reference.castle_recurrent`."""
    with autocast_inputs(qu, ku, vu, qc, kc, vc) as inputs:
        scale = check_castle_inputs(dict(zip(INPUT_NAMES, inputs)), window, scale)
        document_ids = check_castle_documents(document_ids, inputs[0])
        return reference.castle_recurrent(*inputs, window, scale, document_ids)


def castle_parallel_reference(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Theorem 1 with dense [T, T] matrices (O(T^3)): see `farsight.ops.castle.reference.castle_parallel_reference`."""
    with autocast_inputs(qu, ku, vu, qc, kc, vc) as inputs:
        scale = check_castle_inputs(dict(zip(INPUT_NAMES, inputs)), window, scale)
        document_ids = check_castle_documents(document_ids, inputs[0])
        return reference.castle_parallel_reference(*inputs, window, scale, document_ids)
