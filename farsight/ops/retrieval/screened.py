"""Exact top-k retrieval with a bf16 screen: the fast path for long chunk memories.

Scoring every landmark key in fp32 is the cost that grows with the context (n keys per query,
n in the hundreds of thousands at 16M tokens). Here the full scan runs as one bf16 GEMM, whose
error per score is bounded; only the keys that the bound cannot rule out are rescored in the
exact dtype, and the top-k is taken among those exact scores.

Why it is exact. Let u = 2^-9 (bf16's unit roundoff) and e = 2^-24 (fp32's). Rounding q and k
to bf16 and accumulating their products in fp32 gives a' with
|a' - s| <= (2u + u^2 + 2 D e) (1 + u)^2 sum_d |q_d k_d| <= screen_error(D) |q| max_j |k_j| =: c
against the exact fp32 score s (Cauchy-Schwarz; both accumulations counted), and rounding a' to
the bf16 output a adds at most r |a| with r = u / (1 - u). So |a - s| <= E(a) = c + r |a|.
Let a_k be the k-th largest screened score. The k keys with the largest a all have
s >= a - E(a) >= a_k - E(a_k) =: L (a - E(a) grows with a), so the k-th largest exact score is
>= L, and every key of the exact top-k has a + E(a) >= s >= L, i.e. a >= t, where t solves
t + E(t) = L. The screen groups the keys G at a time; a group is kept when its maximum reaches
t computed from the k-th largest group maximum (<= a_k, so t is lower still) for some query,
and the kept groups are rescored for every query in one fp32 GEMM. Exact ties may break
differently from the reference; scores are the same up to the rounding of two fp32
dot-product orders.
"""

from __future__ import annotations

import math

import torch

from farsight.ops.retrieval.reference import retrieval_topk_reference, score_dtype

GROUP = 16  # keys per group: the screen keeps or drops whole groups
RESCORE_LIMIT = 8  # past 1/RESCORE_LIMIT of the keys, gathering and rescoring them costs more than scoring all
BLOCK_SCORES = 1 << 19  # scores per screening GEMM (1 MB of bf16, stays in cache): 8192 keys x 64 queries
UNIT_ROUNDOFF = 2.0**-9  # bf16
OUTPUT_ROUNDING = UNIT_ROUNDOFF / (1 - UNIT_ROUNDOFF)  # r: rounding a product to bf16, relative to the rounded value


def screen_error(d: int) -> float:
    """c / (|q| max |k|): the error of a screened product before its bf16 output rounding
    (module docstring), rounded up by 1%."""
    u = UNIT_ROUNDOFF
    return 1.01 * (2 * u + u * u + 2 * d * 2.0**-24) * (1 + u) ** 2


def _group_maxima(q_low: torch.Tensor, keys_low: torch.Tensor, start: int, stop: torch.Tensor) -> torch.Tensor:
    """The screen: q_low [m, D], keys_low [n, D] bf16 -> the maximum screened score of each
    group of G keys [m, n_groups] (bf16 values in fp32), -inf where no key of the group is a
    candidate. Scores are made a block of keys at a time into one small buffer that stays in
    cache and is never kept."""
    n, m = keys_low.shape[0], q_low.shape[0]
    groups = math.ceil(n / GROUP)
    maxima = torch.empty(groups, m, dtype=torch.bfloat16, device=q_low.device)
    block = GROUP * max(1, BLOCK_SCORES // m // GROUP)
    buffer = torch.empty(block, m, dtype=torch.bfloat16, device=q_low.device)
    q_t = q_low.t().contiguous()
    first_late = int(stop.min())
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        rows = GROUP * math.ceil((hi - lo) / GROUP)
        scores = buffer[:rows]
        torch.mm(keys_low[lo:hi], q_t, out=scores[: hi - lo])  # [block, m]: keys-major, one GEMM
        scores[hi - lo :] = float("-inf")
        if lo < start:
            scores[: start - lo] = float("-inf")
        if hi > first_late:  # keys at or after stop[i] are no candidates of query i
            at = max(lo, first_late)
            late = torch.arange(at, hi, device=q_low.device)[:, None] >= stop[None, :]
            scores[at - lo : hi - lo].masked_fill_(late, float("-inf"))
        torch.amax(scores.view(-1, GROUP, m), dim=1, out=maxima[lo // GROUP : lo // GROUP + rows // GROUP])
    return maxima.t().to(torch.float32, memory_format=torch.contiguous_format)


def _topk_one_row(
    q: torch.Tensor, keys: torch.Tensor, keys_low: torch.Tensor, max_norm: torch.Tensor, k: int, start: int, stop: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: q [m, D] scaled queries in the score dtype, keys [n, D], keys_low [n, D]
    bf16, max_norm >= every |k_j| -> (index [m, min(k, n)], exact scores)."""
    n, m = keys.shape[0], q.shape[0]
    group_max = _group_maxima(q.detach().to(torch.bfloat16), keys_low, start, stop)  # [m, n_groups]
    n_groups = group_max.shape[1]
    # t, the threshold a group's maximum must reach to hold a key of the exact top-k (module
    # docstring); kept finite, so that groups without candidates (maximum -inf) never reach it
    c = screen_error(q.shape[1]) * q.detach().norm(dim=1) * max_norm  # [m]
    if n_groups < k:  # fewer groups than k: every group may hold a top-k key
        kth = torch.full((m,), float("-inf"), device=q.device)
    else:
        kth = group_max.topk(k, dim=1).values[:, -1]
    r = OUTPUT_ROUNDING
    below = kth - r * kth.abs() - 2 * c  # L - c
    threshold = torch.where(below >= 0, below / (1 + r), below / (1 - r)).nan_to_num(float("-inf"))
    threshold = threshold.clamp(min=torch.finfo(torch.bfloat16).min)
    # every group that some query keeps is rescored for all of them in one fp32 GEMM: a key
    # scored exactly is a valid candidate whether or not its query needed it
    groups = (group_max >= threshold[:, None]).any(0).nonzero().squeeze(1)  # [U]
    ids = (groups[:, None] * GROUP + torch.arange(GROUP, device=q.device)).flatten()
    ids = ids[ids < n]  # [U G] key ids, ascending
    # past 1/RESCORE_LIMIT of the keys the scores are too close for the screen to rule much out
    # (a small memory, an untrained model); with fewer ids than k the reference pads with -inf
    if len(ids) * RESCORE_LIMIT > n or len(ids) < min(k, n):
        index, scores = retrieval_topk_reference(q[None], keys[None], k, torch.tensor([start], device=q.device), stop, 1.0)
        return index[0], scores[0]
    exact = q @ keys.index_select(0, ids).to(q.dtype).t()  # [m, U G]
    exact.masked_fill_((ids < start) | (ids >= stop[:, None]), float("-inf"))
    top = exact.topk(min(k, n), dim=1).indices
    return ids[top], exact.gather(1, top)


def retrieval_topk_screened(
    query: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    start: torch.Tensor,
    stop: torch.Tensor,
    scale: float,
    keys_low: torch.Tensor | None = None,
    max_key_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as retrieval_topk_reference. keys_low [B, n, D] is keys in bf16 and
    max_key_norm a scalar >= every key's L2 norm (a long-lived memory keeps both as it grows);
    both are computed here when not given. Non-finite inputs take the reference path."""
    if keys.shape[1] == 0 or query.shape[1] == 0:  # nothing to screen
        return retrieval_topk_reference(query, keys, k, start, stop, scale)
    dtype = score_dtype(query.dtype)
    with torch.autocast(query.device.type, enabled=False):
        q = query.to(dtype) * scale
        if keys_low is None:
            keys_low = keys.detach().to(torch.bfloat16)
        if max_key_norm is None:
            max_key_norm = keys.detach().to(dtype).norm(dim=-1).max()
        if not bool(torch.isfinite(max_key_norm)) or not bool(torch.isfinite(q).all()):
            return retrieval_topk_reference(query, keys, k, start, stop, scale)
        results = [
            _topk_one_row(q[b], keys[b], keys_low[b], max_key_norm.to(dtype), k, int(start[b]), stop)
            for b in range(query.shape[0])
        ]
    return torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])
