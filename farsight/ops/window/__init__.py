"""Causal sliding-window attention: dense reference and the blockwise O(T * W) path."""

from __future__ import annotations

import torch

from farsight.ops.checks import check_float, check_positive_int, check_same_dtype_device, check_shape, check_tensor
from farsight.ops.window.blockwise import default_block_size, sliding_window_attention_blockwise
from farsight.ops.window.reference import sliding_window_attention_reference

__all__ = [
    "sliding_window_attention",
    "sliding_window_attention_blockwise",
    "sliding_window_attention_reference",
    "default_block_size",
]


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Causal attention over the last `window` positions (the query's own included).

    q [B, Tq, H, d]; k, v [B, Tk, H, d] with Tk >= Tq: the queries are the last Tq positions,
    so a decode step passes its cached keys in front of the new ones. alibi_slopes [H] adds
    -slope * distance; key_padding_mask [B, Tk] (True = real token) hides padding keys.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
        check_float(name, x)
    check_same_dtype_device({"q": q, "k": k, "v": v})
    batch, tq, heads, dim = q.shape
    check_shape("k", k, (batch, -1, heads, dim), "batch, keys, heads and head dim of q")
    check_shape("v", v, tuple(k.shape), "same shape as k")
    if k.shape[1] < tq:
        raise ValueError(f"k has {k.shape[1]} positions but q has {tq}; queries must be the last positions of the keys")
    check_positive_int("window", window)
    check_positive_int("block_size", block_size, allow_none=True)
    if alibi_slopes is not None:
        check_shape("alibi_slopes", alibi_slopes, (heads,), "one slope per head")
    if key_padding_mask is not None:
        check_shape("key_padding_mask", key_padding_mask, (batch, k.shape[1]), "batch x keys")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True marks real tokens)")
    if tq == 0:
        return q.new_empty(q.shape)
    return sliding_window_attention_blockwise(q, k, v, window, alibi_slopes, scale, key_padding_mask, block_size)
