"""What the exact screens of retrieval share: screened scores reduced to maxima over groups of
`group` consecutive keys, and the exact top-k from the groups that a bound on the screen's error
cannot rule out (the bf16 screen in farsight.ops.retrieval.screened, the low-rank one in .lowrank;
each picks its group size).

The rule. A screen gives, for query i and group g, the largest screened score M[i, g] of the
group's keys and a bound E[i, g] such that every key of g has an exact score <= M + E and the key
that attains M has one >= M - E. Let L_i be the k-th largest of M[i, g] - E[i, g] over the
groups: k keys (one per group) score >= L_i exactly, so every key of the exact top-k lies in a
group with M[i, g] + E[i, g] >= L_i. The groups that some query keeps are gathered once and
rescored for every query in one GEMM in the score dtype (a key scored exactly is a valid
candidate whether or not its query needed it), and the top-k is taken among those scores.
Exact ties may break differently from the reference; scores are the same up to the rounding of
two dot-product orders.
"""

from __future__ import annotations

import math

import torch

from farsight.ops.retrieval.reference import retrieval_topk_reference

RESCORE_LIMIT = 8  # past 1/RESCORE_LIMIT of the keys, gathering and rescoring them costs more than scoring all
BLOCK_SCORES = 1 << 19  # scores per screening GEMM (1-2 MB, stays in cache): 8192 keys x 64 queries


def group_maxima(
    q_screen: torch.Tensor, keys_screen: torch.Tensor, start: int, stop: torch.Tensor, group: int
) -> torch.Tensor:
    """q_screen [m, r], keys_screen [n, r] (the screen's cheap operands, one dtype) -> the
    largest screened score of each group of `group` keys [m, n_groups] (in that dtype's score
    dtype), -inf where no key of the group is a candidate (j < start or j >= stop[i]). Scores
    are made a block of keys at a time into one small buffer that stays in cache and is never
    kept."""
    n, m = keys_screen.shape[0], q_screen.shape[0]
    groups = math.ceil(n / group)
    maxima = torch.empty(groups, m, dtype=keys_screen.dtype, device=q_screen.device)
    block = group * max(1, BLOCK_SCORES // m // group)
    buffer = torch.empty(block, m, dtype=keys_screen.dtype, device=q_screen.device)
    q_t = q_screen.t().contiguous()
    first_late = int(stop.min())
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        rows = group * math.ceil((hi - lo) / group)
        scores = buffer[:rows]
        torch.mm(keys_screen[lo:hi], q_t, out=scores[: hi - lo])  # [block, m]: keys-major, one GEMM
        scores[hi - lo :] = float("-inf")
        if lo < start:
            scores[: start - lo] = float("-inf")
        if hi > first_late:  # keys at or after stop[i] are no candidates of query i
            at = max(lo, first_late)
            late = torch.arange(at, hi, device=q_screen.device)[:, None] >= stop[None, :]
            scores[at - lo : hi - lo].masked_fill_(late, float("-inf"))
        torch.amax(scores.view(-1, group, m), dim=1, out=maxima[lo // group : lo // group + rows // group])
    return maxima.t().to(torch.promote_types(keys_screen.dtype, torch.float32), memory_format=torch.contiguous_format)


def topk_from_groups(
    q: torch.Tensor,
    keys: torch.Tensor,
    group_max: torch.Tensor,
    error: torch.Tensor,
    k: int,
    start: int,
    stop: torch.Tensor,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: q [m, D] scaled queries in the score dtype, keys [n, D], group_max [m, G]
    and error [m, G] (finite, >= 0) over groups of `group` keys as in the module docstring ->
    (index [m, min(k, n)], exact scores). Falls back to scoring every key when the screen rules
    out too little."""
    n, m = keys.shape[0], q.shape[0]
    if group_max.shape[1] < k:  # fewer groups than k: every group may hold a top-k key
        kth = torch.full((m,), float("-inf"), dtype=group_max.dtype, device=q.device)
    else:
        kth = (group_max - error).topk(k, dim=1).values[:, -1]
    # kept finite, so that groups without candidates (maximum -inf) never reach it
    kth = kth.clamp(min=-torch.finfo(group_max.dtype).max)
    groups = (group_max + error >= kth[:, None]).any(0).nonzero().squeeze(1)  # [U]
    ids = (groups[:, None] * group + torch.arange(group, device=q.device)).flatten()
    ids = ids[ids < n]  # [U group] key ids, ascending
    # past 1/RESCORE_LIMIT of the keys the screen rules out too little (a small memory, scores
    # too close together, an untrained model); with fewer ids than k the reference pads with -inf
    if len(ids) * RESCORE_LIMIT > n or len(ids) < min(k, n):
        index, scores = retrieval_topk_reference(
            q[None], keys[None], k, torch.tensor([start], device=q.device), stop, 1.0
        )
        return index[0], scores[0]
    exact = q @ keys.index_select(0, ids).to(q.dtype).t()  # [m, U group]
    exact.masked_fill_((ids < start) | (ids >= stop[:, None]), float("-inf"))
    top = exact.topk(min(k, n), dim=1).indices
    return ids[top], exact.gather(1, top)
