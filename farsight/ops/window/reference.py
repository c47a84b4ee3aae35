"""Dense reference for causal sliding-window attention: a full [Tq, Tk] score matrix with a mask.

O(T^2) time and memory; it exists to test the blockwise path and for tiny inputs.
"""

from __future__ import annotations

import torch

from farsight.ops.checks import compute_dtype


def window_mask_and_distance(
    tq: int, tk: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allowed-key mask and query-key distance for queries at the last `tq` of `tk` positions.

    Query i sits at absolute position tk - tq + i. Key j is allowed when
    0 <= pos(i) - j < window (window=None: all earlier keys). Returns (mask [tq, tk] bool, distance [tq, tk]).
    """
    qpos = torch.arange(tk - tq, tk, device=device)[:, None]
    kpos = torch.arange(tk, device=device)[None, :]
    distance = qpos - kpos
    mask = distance >= 0
    if window is not None:
        mask &= distance < window
    return mask, distance


def sliding_window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Tq, H, d], k/v [B, Tk, H, d] with Tk >= Tq -> o [B, Tq, H, d].

    alibi_slopes [H] adds -slope * (query position - key position) to the scores.
    key_padding_mask [B, Tk] bool, True for real keys; a query always keeps itself (so no row
    is fully masked and -inf is safe). fp16/bf16 inputs are computed in fp32 (fp64 stays fp64),
    ALiBi included, and the output has q's dtype.
    """
    tq, tk, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    work = compute_dtype(q.dtype)
    mask, distance = window_mask_and_distance(tq, tk, window, q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(work), k.to(work)) * scale
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(work)[:, None, None] * distance.to(work)
    mask = mask[None, None].expand(q.shape[0], 1, tq, tk)
    if key_padding_mask is not None:
        mask = mask & (key_padding_mask[:, None, None, :] | (distance == 0))
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.to(work)).to(q.dtype)
