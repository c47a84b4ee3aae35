"""Retrieval scoring for DRT (docs/design.md §2.3): each query (a chunk's landmark state, projected) scores
the landmark keys of the chunks it may read and keeps the top k.

`retrieval_scores` gives every score (the training path: Gumbel noise and the random retriever
need them all), `retrieval_topk_reference` its top-k, and two screens give the same top-k for
inference over long memories, each from cheap scores plus an exact rescoring of the few keys it
cannot rule out: `retrieval_topk_screened` scans the keys in bf16 (where bf16 GEMMs run in
hardware), `retrieval_topk_lowrank` in a low-rank basis of the keys in fp32 (`LowRankKeys`).
`retrieval_topk` checks the inputs and picks one; `screen_pays_off` says whether "auto" may take
the bf16 screen on a device. `retrieval_target_loss` scores a retriever against the chunks a task
says hold the evidence (supervised retrieval, farsight's extension, docs/design.md §2.7).

Candidates: query i of batch row b may retrieve key j when start[b] <= j < stop[i] (keys before
start[b] are left padding, keys from stop[i] on are its own chunk or later).
"""

from __future__ import annotations

import torch

from farsight.errors import InputError
from farsight.ops.checks import check_float, check_positive_int, check_tensor
from farsight.ops.precision import native_bf16_matmul
from farsight.ops.retrieval.lowrank import LowRankKeys, retrieval_topk_lowrank
from farsight.ops.retrieval.neighbors import add_neighbors, neighbor_offsets
from farsight.ops.retrieval.reference import retrieval_scores, retrieval_topk_reference, score_dtype
from farsight.ops.retrieval.screened import retrieval_topk_screened
from farsight.ops.retrieval.targets import retrieval_target_loss

__all__ = [
    "BACKENDS",
    "LOW_RANK_MIN_KEYS",
    "LOW_RANK_OVER_BF16_KEYS",
    "LowRankKeys",
    "add_neighbors",
    "neighbor_offsets",
    "retrieval_scores",
    "retrieval_target_loss",
    "retrieval_topk",
    "retrieval_topk_lowrank",
    "retrieval_topk_reference",
    "retrieval_topk_screened",
    "score_dtype",
    "screen_pays_off",
]

BACKENDS = ("auto", "screened", "lowrank", "reference")
# Below this many keys the full fp32 scan is as cheap as a screen and its rescoring.
SCREEN_MIN_KEYS = 1024
# A memory fits the low-rank screen's basis from this many keys on: in the demo model's prefill
# the screen was 4% slower than the fp32 scan at 2K-8K keys (64K-256K tokens) and faster from
# 32K keys on (1.10x the whole prefill at 1M tokens, 1.28x at 4M; 2-core AVX2 EPYC).
LOW_RANK_MIN_KEYS = 16384
# Where the bf16 screen pays, the low-rank one takes over from this many keys: in the demo model's
# bf16 prefill of real text on a Xeon with AMX-BF16, scoring + top-k took 14.0% of 1M tokens with
# the low-rank screen from 16K keys against 12.1% with the bf16 one; with the takeover here, 33.4%
# of 16M tokens against 42.7%, 1.12x the whole prefill (benchmarks/drt.py --split-lowrank-baseline).
LOW_RANK_OVER_BF16_KEYS = 65536


def screen_pays_off(device: torch.device) -> bool:
    """Whether "auto" may take the bf16 screen for long memories on `device`: it trades the fp32
    scan for a bf16 GEMM, which only pays where bf16 matmuls run in hardware. On a CPU without
    bf16 instructions it ran 10-15x slower than the scan (benchmarks/retrieval.py on a 2-core
    AVX2 EPYC), where an AVX512-BF16 EPYC ran it 1.5-4.8x faster."""
    return native_bf16_matmul(device)


def retrieval_topk(
    query: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    start: torch.Tensor,
    stop: torch.Tensor,
    scale: float,
    keys_low: torch.Tensor | None = None,
    max_key_norm: torch.Tensor | None = None,
    low_rank: LowRankKeys | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, m, D], keys [B, n, D], start [B], stop [m] (long) -> (index [B, m, min(k, n)],
    scores [B, m, min(k, n)]) in score_dtype, differentiable in query and keys; a score is -inf
    where query i has fewer than k candidates. keys_low / max_key_norm: see the bf16 screen;
    low_rank: the keys' LowRankKeys, for the low-rank screen.

    "auto": the reference below SCREEN_MIN_KEYS keys; above, the low-rank screen when low_rank
    has a basis and either the bf16 screen does not pay (`screen_pays_off`) or there are
    LOW_RANK_OVER_BF16_KEYS keys or more; else the bf16 screen where it pays, else the reference.
    """
    check_tensor("query", query, 3)
    check_tensor("keys", keys, 3)
    check_float("query", query)
    check_float("keys", keys)
    check_positive_int("k", k)
    if keys.shape[0] != query.shape[0] or keys.shape[2] != query.shape[2]:
        raise InputError(f"keys {tuple(keys.shape)} must be [B, n, D] for query {tuple(query.shape)}; match B and D")
    if tuple(start.shape) != (query.shape[0],) or tuple(stop.shape) != (query.shape[1],):
        raise InputError(
            f"start must be [B] and stop [m] for query {tuple(query.shape)}, got {tuple(start.shape)} and {tuple(stop.shape)}"
        )
    if keys_low is not None and (keys_low.shape != keys.shape or keys_low.dtype != torch.bfloat16):
        raise InputError(
            f"keys_low must be keys {tuple(keys.shape)} in bfloat16, got {tuple(keys_low.shape)} {keys_low.dtype}"
        )
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "auto":
        fitted = low_rank is not None and low_rank.basis is not None
        native = screen_pays_off(keys.device)
        if keys.shape[1] < SCREEN_MIN_KEYS:
            backend = "reference"
        elif fitted and (not native or keys.shape[1] >= LOW_RANK_OVER_BF16_KEYS):
            backend = "lowrank"
        else:
            backend = "screened" if native else "reference"
    if backend == "reference":
        return retrieval_topk_reference(query, keys, k, start, stop, scale)
    if backend == "lowrank":
        return retrieval_topk_lowrank(query, keys, k, start, stop, scale, low_rank)
    return retrieval_topk_screened(query, keys, k, start, stop, scale, keys_low, max_key_norm)
