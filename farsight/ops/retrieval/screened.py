"""Exact top-k retrieval with a bf16 screen: the fast path for long chunk memories.

Scoring every landmark key in fp32 is the cost that grows with the context (n keys per query,
n in the hundreds of thousands at 16M tokens). Here the full scan runs as one bf16 GEMM, whose
error per score is bounded; only the keys that the bound cannot rule out are rescored in the
exact dtype, and the top-k is taken among those exact scores.

Why it is exact. Let u = 2^-8 (bf16's unit roundoff: 8 significant bits, so rounding moves a
value by up to 2^-8 of it) and e = 2^-24 (fp32's). Rounding q and k to bf16 and accumulating
their products in fp32 gives a' with
|a' - s| <= (2u + u^2 + 2 D e) (1 + u)^2 sum_d |q_d k_d| <= screen_error(D) |q| max_j |k_j| =: c
against the exact fp32 score s (Cauchy-Schwarz; both accumulations counted), and rounding a' to
the bf16 output a adds at most r |a| with r = u / (1 - u). So |a - s| <= E(a) = c + r |a|.
Both a + E(a) and a - E(a) grow with a, so for a group of keys whose largest screened score
is M, every key scores at most M + E(M) exactly and the key at M at least M - E(M): the bound
that farsight.ops.retrieval.groups turns into the exact top-k (groups of 16 keys, the kept ones
rescored in fp32).
"""

from __future__ import annotations

import torch

from farsight.ops.retrieval.groups import group_maxima, topk_from_groups
from farsight.ops.retrieval.reference import retrieval_topk_reference, score_dtype

GROUP = 16  # keys per group (farsight.ops.retrieval.groups)
UNIT_ROUNDOFF = 2.0**-8  # bf16 (torch.finfo(torch.bfloat16).eps / 2)
OUTPUT_ROUNDING = UNIT_ROUNDOFF / (1 - UNIT_ROUNDOFF)  # r: rounding a product to bf16, relative to the rounded value


def screen_error(d: int) -> float:
    """c / (|q| max |k|): the error of a screened product before its bf16 output rounding
    (module docstring), rounded up by 1%."""
    u = UNIT_ROUNDOFF
    return 1.01 * (2 * u + u * u + 2 * d * 2.0**-24) * (1 + u) ** 2


def _topk_one_row(
    q: torch.Tensor,
    keys: torch.Tensor,
    keys_low: torch.Tensor,
    max_norm: torch.Tensor,
    k: int,
    start: int,
    stop: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: q [m, D] scaled queries in the score dtype, keys [n, D], keys_low [n, D]
    bf16, max_norm >= every |k_j| -> (index [m, min(k, n)], exact scores)."""
    group_max = group_maxima(q.detach().to(torch.bfloat16), keys_low, start, stop, GROUP)  # [m, n_groups]
    # E(a) = c + r |a| grows with a, so E(M) bounds the error of every key at or below M
    c = screen_error(q.shape[1]) * q.detach().norm(dim=1) * max_norm  # [m]
    size = group_max.abs().nan_to_num(posinf=0.0)  # groups without candidates (-inf) add nothing
    return topk_from_groups(q, keys, group_max, c[:, None] + OUTPUT_ROUNDING * size, k, start, stop, GROUP)


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
