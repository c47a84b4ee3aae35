"""Retrieval scoring, the readable definition: every candidate key scored, masked, top-k."""

from __future__ import annotations

import torch


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are fp32 (fp64 for fp64 inputs) whatever the compute dtype: bf16 scores tie often
    enough to change the top-k, and fp16 cannot hold large scores."""
    return torch.promote_types(dtype, torch.float32)


def retrieval_scores(
    query: torch.Tensor, keys: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [B, m, D], keys [B, n, D] -> scores [B, m, n] = scale * q_i . k_j in score_dtype,
    -inf where key j is no candidate of query i in row b (j < start[b] or j >= stop[i])."""
    dtype = score_dtype(query.dtype)
    n = keys.shape[1]
    with torch.autocast(query.device.type, enabled=False):
        scores = torch.einsum("bmd,bnd->bmn", query.to(dtype) * scale, keys.to(dtype))
    # masked in place, and only where a mask can hold: the keys from the earliest stop on, and
    # the rows' leading keys when some start is above 0
    first = min(n, int(stop.min())) if len(stop) else n
    late = torch.arange(first, n, device=scores.device) >= stop[:, None]  # [m, n - first]
    scores[:, :, first:].masked_fill_(late, float("-inf"))
    if bool((start > 0).any()):
        early = torch.arange(n, device=scores.device) < start[:, None]  # [B, n]
        scores.masked_fill_(early[:, None], float("-inf"))
    return scores


def retrieval_topk_reference(
    query: torch.Tensor, keys: torch.Tensor, k: int, start: torch.Tensor, stop: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (index [B, m, min(k, n)] key ids, their scores); a score is -inf where query i has
    fewer than k candidates (its index is then arbitrary)."""
    scores = retrieval_scores(query, keys, start, stop, scale)
    top = scores.topk(min(k, keys.shape[1]), dim=-1).indices
    return top, scores.gather(-1, top)
