"""Dense reference for causal sliding-window attention: a full [Tq, Tk] score matrix with a mask.

O(T^2) time and memory; it exists to test the other paths (blockwise, banded, FlexAttention, SDPA)
and for tiny inputs, so it shares no code with them: it writes its own mask (`reference_mask`).
"""

from __future__ import annotations

import torch

from farsight.ops.checks import compute_dtype
from farsight.ops.documents import same_document


def reference_mask(
    tq: int,
    tk: int,
    window: int | None,
    key_padding_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Which keys each query sees: [B or 1, 1, Tq, Tk] bool, True = attended.

    Query i sits at position tk - tq + i and sees key j when 0 <= position - j < window, the key
    is real (key_padding_mask [B, Tk], True = real; a query always keeps its own key) and, with
    document_ids [B, Tk], when query and key share a document.
    """
    distance = torch.arange(tk - tq, tk, device=device)[:, None] - torch.arange(tk, device=device)[None, :]
    mask = ((distance >= 0) & (distance < (tk if window is None else window)))[None, None]
    if key_padding_mask is not None:
        mask = mask & (key_padding_mask[:, None, None, :] | (distance == 0))
    if document_ids is not None:
        mask = mask & same_document(document_ids[:, tk - tq :], document_ids)[:, None]
    return mask


def sliding_window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Tq, H, d], k/v [B, Tk, H, d] with Tk >= Tq -> o [B, Tq, H, d].

    alibi_slopes [H] adds -slope * (query position - key position) to the scores.
    key_padding_mask [B, Tk] bool, True for real keys; a query always keeps itself (so no row
    is fully masked and -inf is safe). document_ids [B, Tk] integer (non-decreasing along a row,
    see `farsight.ops.documents`): a query sees only the keys of its own document (its own key
    among them). fp16/bf16 inputs are computed in fp32 (fp64 stays fp64), ALiBi included, and
    the output has q's dtype.
    """
    tq, tk, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    work = compute_dtype(q.dtype)
    # query i sits at position tk - tq + i
    distance = torch.arange(tk - tq, tk, device=q.device)[:, None] - torch.arange(tk, device=q.device)[None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(work), k.to(work)) * scale
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(work)[:, None, None] * distance.to(work)
    mask = reference_mask(tq, tk, window, key_padding_mask, document_ids, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.to(work)).to(q.dtype)
