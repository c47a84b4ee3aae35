"""Supervised retrieval's loss (farsight.ops.retrieval.retrieval_target_loss) against a loop over
the retrievals, written from its definition."""

from __future__ import annotations

import math

import pytest
import torch

from farsight.ops.retrieval import retrieval_target_loss


def _loop_reference(scores, asking, targets, k):
    """Per retrieval: the mean over its target candidates of -log softmax, and whether its k
    best candidates hold min(targets, k) of them; retrievals without a target candidate are not
    counted."""
    loss = scores.new_zeros(())
    counted = found = 0
    b, m, n = scores.shape
    for row in range(b):
        for i in range(m):
            if not asking[row, i]:
                continue
            evidence = targets[row] if targets.dim() == 2 else targets[row, i]
            candidates = [j for j in range(n) if math.isfinite(float(scores[row, i, j].detach()))]
            wanted = [j for j in candidates if evidence[j]]
            if not wanted:
                continue
            values = torch.stack([scores[row, i, j] for j in candidates])
            total = torch.logsumexp(values, 0)
            loss = loss + sum(total - scores[row, i, j] for j in wanted) / len(wanted)
            counted += 1
            best = sorted(candidates, key=lambda j: -float(scores[row, i, j].detach()))[:k]
            found += sum(bool(evidence[j]) for j in best) >= min(len(wanted), k)
    return loss, counted, found


def _case(b, m, n, seed, dtype=torch.float64, per_retrieval=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, m, n, generator=g, dtype=dtype) * 3
    # causal candidates as in DRT: landmark i scores chunks j < i; some rows lose their leading chunks
    stop = torch.arange(m)[:, None]
    start = torch.randint(0, 3, (b,), generator=g)[:, None, None]
    keep = (torch.arange(n) < stop) & (torch.arange(n) >= start)
    scores = scores.masked_fill(~keep, float("-inf"))
    asking = torch.rand(b, m, generator=g) < 0.6
    targets = torch.rand(*((b, m, n) if per_retrieval else (b, n)), generator=g) < 0.2
    return scores, asking, targets


@pytest.mark.parametrize("per_retrieval", [False, True], ids=["row-evidence", "retrieval-evidence"])
@pytest.mark.parametrize(("b", "m", "n", "k"), [(2, 9, 9, 2), (3, 17, 17, 4), (1, 5, 5, 8), (2, 33, 33, 1)])
def test_loss_counts_and_gradients_equal_the_loop_in_fp64(b, m, n, k, per_retrieval):
    scores, asking, targets = _case(b, m, n, seed=m, per_retrieval=per_retrieval)
    ours = scores.clone().requires_grad_()
    theirs = scores.clone().requires_grad_()
    loss, counted, found = retrieval_target_loss(ours, asking, targets, k)
    ref_loss, ref_counted, ref_found = _loop_reference(theirs, asking, targets, k)
    assert ref_counted > 0
    assert int(counted) == ref_counted and int(found) == ref_found
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(ours.grad).all()


def test_a_retrieval_whose_evidence_is_no_candidate_is_not_counted():
    # landmark 2 may read chunks 0 and 1; the evidence sits in chunk 2 (its own, inside the window)
    scores = torch.tensor([[[0.0, 1.0, float("-inf")]]], dtype=torch.float64).expand(1, 3, 3).clone()
    asking = torch.tensor([[False, False, True]])
    targets = torch.tensor([[False, False, True]])
    loss, counted, found = retrieval_target_loss(scores, asking, targets, 1)
    assert float(loss) == 0.0 and int(counted) == 0 and int(found) == 0


def test_each_evidence_chunk_is_pulled_in_not_only_their_sum():
    scores = torch.tensor([[[0.0, math.log(3.0), math.log(6.0)]]], dtype=torch.float64)
    asking, targets = torch.tensor([[True]]), torch.tensor([[True, True, False]])
    loss, counted, found = retrieval_target_loss(scores, asking, targets, 2)
    assert int(counted) == 1 and int(found) == 0  # the best candidate, chunk 2, is no evidence
    assert float(loss) == pytest.approx(-(math.log(1 / 10) + math.log(3 / 10)) / 2)
    # one evidence chunk holding all the weight is no optimum: the loss is lowest with it shared
    lopsided = torch.tensor([[[0.0, 30.0, -30.0]]], dtype=torch.float64)
    shared = torch.tensor([[[15.0, 15.0, -30.0]]], dtype=torch.float64)
    assert float(retrieval_target_loss(shared, asking, targets, 2)[0]) == pytest.approx(math.log(2))
    assert float(retrieval_target_loss(lopsided, asking, targets, 2)[0]) > 14
    assert int(retrieval_target_loss(shared, asking, targets, 2)[2]) == 1
    assert int(retrieval_target_loss(shared, asking, targets, 1)[2]) == 1  # k = 1: one of them suffices


def test_empty_inputs_give_zeros():
    for b, m, n in [(0, 3, 3), (2, 0, 0), (2, 3, 0)]:
        scores = torch.zeros(b, m, n).requires_grad_()
        loss, counted, found = retrieval_target_loss(
            scores, torch.ones(b, m, dtype=torch.bool), torch.ones(b, n, dtype=torch.bool), 4
        )
        assert float(loss.detach()) == 0.0 and int(counted) == 0 and int(found) == 0
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scores_give_an_fp32_loss_close_to_fp64(dtype):
    scores, asking, targets = _case(2, 17, 17, seed=3)
    low = scores.to(dtype)
    loss, counted, found = retrieval_target_loss(low.float().to(dtype), asking, targets, 4)
    ref, ref_counted, _ = _loop_reference(low.double(), asking, targets, 4)
    assert loss.dtype == torch.float32 and int(counted) == ref_counted
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_per_retrieval_evidence_equal_to_the_rows_gives_the_rows_loss():
    scores, asking, targets = _case(2, 17, 17, seed=3)
    expanded = targets[:, None, :].expand(-1, 17, -1)
    for a, b in zip(
        retrieval_target_loss(scores, asking, targets, 2), retrieval_target_loss(scores, asking, expanded, 2)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a retrieval whose own evidence is empty is not counted, whatever the row's evidence
    emptied = expanded.clone()
    emptied[:, 5] = False
    counted_all = int(retrieval_target_loss(scores, asking, expanded, 2)[1])
    counted = int(retrieval_target_loss(scores, asking, emptied, 2)[1])
    assert counted == counted_all - int((asking[:, 5] & (expanded[:, 5] & torch.isfinite(scores[:, 5])).any(-1)).sum())
