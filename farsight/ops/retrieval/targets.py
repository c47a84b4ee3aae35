"""Supervised retrieval: how well a retriever's scores find the chunks a task says hold the answer.

DRT's retriever learns only through the GCA weights of the chunks it retrieved (docs/design.md
§2.3): a chunk outside the top k gets no gradient, so where many chunks look alike (RULER's
multi-key haystacks of needles that differ only in their key) the right one is rarely drawn and
its score rarely learnt. Where the data knows which chunks hold the evidence (farsight's needle
tasks do), `retrieval_target_loss` scores every candidate against them: the cross-entropy of a
softmax over the candidates' scores with the evidence chunks as the target set (their
probabilities summed). This is farsight's extension, not the paper's training (docs/design.md
§2.7).
"""

from __future__ import annotations

import torch


def retrieval_target_loss(
    scores: torch.Tensor, asking: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [B, m, n] (landmark i's score of chunk j; -inf = no candidate), asking [B, m] bool
    (the retrievals to supervise), targets bool, [B, n] (the chunks holding evidence, for every
    retrieval of a row) or [B, m, n] (each retrieval's own evidence: a row that asks about several
    needles), k (how many chunks a retrieval reads) -> (loss sum, supervised retrievals, found),
    each a 0-dim tensor.

    A retrieval's loss is the mean over its evidence chunks E (the target candidates) of
    -log softmax(scores[b, i])[j]: every chunk of the evidence is pulled into the top k and given
    an equal share of the weight, so that a value split across two chunks is read whole (a target
    that summed E's probabilities would be met by one of them alone). Summed over the asking
    retrievals with at least one target among their candidates; the others (evidence inside the
    window or not yet written) are not counted. found counts those whose k best candidates hold
    min(|E|, k) evidence chunks. Differentiable in scores; fp32 or wider."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dtype)
    candidate = torch.isfinite(scores)  # [B, m, n]
    wanted = candidate & (targets[:, None, :] if targets.dim() == 2 else targets)
    n_wanted = wanted.sum(-1)  # [B, m]
    counted = asking & (n_wanted > 0)
    low = torch.finfo(dtype).min
    # a finite stand-in for non-candidates keeps log_softmax and its backward free of NaN
    log_p = torch.log_softmax(torch.where(candidate, scores, low), dim=-1)
    per_retrieval = -torch.where(wanted, log_p, torch.zeros_like(log_p)).sum(-1) / n_wanted.clamp(min=1)
    loss = torch.where(counted, per_retrieval, torch.zeros_like(per_retrieval)).sum()
    best = torch.where(candidate, scores.detach(), low).topk(min(k, scores.shape[-1]), dim=-1).indices
    held = (wanted.gather(-1, best) & candidate.gather(-1, best)).sum(-1)
    found = counted & (held >= n_wanted.clamp(max=k))
    return loss, counted.sum(), found.sum()
