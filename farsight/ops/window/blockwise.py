"""Causal sliding-window attention in O(T * W) time and memory, for any device.

Queries are cut into blocks of `block` rows; block i only needs the `block + W - 1` keys that end
at its last row, which `unfold` exposes as an overlapping view. Scores are therefore
[B, H, n_blocks, block, block + W - 1] instead of [B, H, T, T], and plain autograd gives a
backward with the same footprint (FlexAttention, which would do this on GPU, has no CPU backward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from farsight.ops.checks import compute_dtype


def pad_document_ids(document_ids: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """[B, T] ids -> [B, left + T + right]: the first document extended over the left padding and
    the last over the right (padded positions join a document, so no padded query row loses its
    own key and no id is invented; the padded keys are masked, or out of reach, on their own)."""
    parts = [document_ids[:, :1].expand(-1, left), document_ids, document_ids[:, -1:].expand(-1, right)]
    return torch.cat(parts, dim=1)


def default_block_size(window: int) -> int:
    # Blocks about as long as the window waste at most half of the score tile on masked entries
    # while keeping the number of (vectorised) blocks small.
    return min(max(window, 16), 256)


def sliding_window_attention_blockwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Tq, H, d], k/v [B, Tk, H, d] (Tk >= Tq; queries are the last Tq positions) -> [B, Tq, H, d].

    Key j is visible to the query at position p when p - window < j <= p (and, with
    document_ids [B, Tk], when both share a document). Semantics match
    `sliding_window_attention_reference` exactly. The two matrix products run in the input
    precision (fp16/bf16 products accumulate in fp32 inside the GEMM, ~4.5x faster than fp32 on
    CPUs with bf16 instructions, and come out rounded to that dtype); the ALiBi bias, the mask
    and the softmax are fp32 (fp64 for fp64 inputs). The output has q's dtype. The band mask is
    an additive -inf, so the keys a query does not see must give finite scores (an fp16 score
    past 65504 there gives NaN, where no other op would have overflowed).
    """
    batch, tq, heads, dim = q.shape
    tk = k.shape[1]
    offset = tk - tq
    scale = dim**-0.5 if scale is None else scale
    block = min(block_size or default_block_size(window), tq)
    n_blocks = math.ceil(tq / block)
    span = block + window - 1
    pad_left = max(0, window - 1 - offset)
    pad_right = n_blocks * block - tq
    start = pad_left + offset - (window - 1)
    work = compute_dtype(q.dtype)  # bias, mask and softmax

    def key_windows(x: torch.Tensor) -> torch.Tensor:
        # [B, Tk, H, d] -> [B, H, n_blocks, span, d], a view on the padded keys where possible
        x = F.pad(x.transpose(1, 2), (0, 0, pad_left, pad_right))[:, :, start:]
        return x.unfold(2, span, block).transpose(-1, -2)

    # Row r of a block sits at distance r + window - 1 - c from column c of its key window.
    rows = torch.arange(block, device=q.device)[:, None]
    cols = torch.arange(span, device=q.device)[None, :]
    distance = rows + (window - 1) - cols
    # One additive term for every block, [H or 1, 1, block, span] in `work`: -inf outside the
    # band, minus the ALiBi bias inside it. Adding it is the scores' only pass before the softmax
    # (and it takes them from the matmul's dtype to `work`).
    bias = torch.zeros(distance.shape, dtype=work, device=q.device)
    bias.masked_fill_((distance < 0) | (distance >= window), float("-inf"))
    if alibi_slopes is not None:
        bias = bias - alibi_slopes.to(work).reshape(heads, 1, 1, 1) * distance.to(work)
    # scaled before the product so that fp16 scores stay far from overflow
    qb = F.pad((q * scale).transpose(1, 2), (0, 0, 0, pad_right)).reshape(batch, heads, n_blocks, block, dim)
    scores = torch.matmul(qb, key_windows(k).transpose(-1, -2)) + bias
    hidden, first = None, 0
    if key_padding_mask is not None or pad_left:
        # Hide padding keys and the keys before the sequence (these reach only the first
        # ceil(pad_left / block) blocks; the right padding lies outside every real row's band).
        # A query always keeps itself, so rows of padding never become all -inf (NaN in backward).
        valid = torch.ones(tk, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        valid = F.pad(valid.reshape(-1, tk), (pad_left, pad_right), value=False)[:, start:]
        valid = valid.unfold(1, span, block)[:, None]  # [B or 1, 1, n_blocks, span]
        hidden = ~(valid[..., None, :] | (distance == 0))
        first = n_blocks if key_padding_mask is not None else min(n_blocks, -(-pad_left // block))
    if document_ids is not None:
        # Hide the keys of other documents: the ids of each block's rows against those of its
        # key window, [B, 1, n_blocks, block, span]. Padded rows and keys extend the first and
        # last documents, so every row keeps its own (distance 0) key.
        key_ids = pad_document_ids(document_ids, pad_left, pad_right)[:, start:].unfold(1, span, block)
        query_ids = pad_document_ids(document_ids[:, offset:], 0, pad_right).view(batch, n_blocks, block)
        other = (query_ids[..., :, None] != key_ids[..., None, :])[:, None]
        hidden, first = (other if hidden is None else hidden | other), n_blocks
    if hidden is not None:
        scores[:, :, :first].masked_fill_(hidden[:, :, :first], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, key_windows(v))
    out = out.reshape(batch, heads, n_blocks * block, dim)[:, :, :tq]
    return out.transpose(1, 2).to(q.dtype)
