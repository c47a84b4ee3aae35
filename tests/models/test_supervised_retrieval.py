"""Supervised retrieval in a causal-retrieval model's forward (`retrieval_targets`): which
retrievals it supervises toward which chunks, that it leaves the language model's output alone,
and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

import farsight.models.causal_retrieval as causal_retrieval
from farsight.errors import InputError
from farsight.models.drt import DRTConfig, DRTForCausalLM

S = 4  # chunk size


def _model(**overrides):
    torch.manual_seed(0)
    config = dict(
        vocab_size=260, d_model=32, n_layers=4, n_heads=2, chunk_size=S, window=8, top_k=2, groups=2, encoder_layers=1
    )
    return DRTForCausalLM(DRTConfig(**(config | overrides)))


def _targets(b, length, evidence, answers):
    targets = torch.zeros(b, length, dtype=torch.long)
    for row, (start, stop) in evidence.items():
        targets[row, start:stop] = 1
    for row, (start, stop) in answers.items():
        targets[row, start:stop] = 2
    return targets


def _capture(monkeypatch):
    """Record what the model hands the loss: (asking [B, m], targets [B, m, n]) per group."""
    seen = []
    real = causal_retrieval.retrieval_target_loss

    def spy(scores, asking, targets, k):
        seen.append((asking.clone(), targets.clone()))
        return real(scores, asking, targets, k)

    monkeypatch.setattr(causal_retrieval, "retrieval_target_loss", spy)
    return seen


def test_the_retrieval_made_before_the_answers_chunk_is_supervised_toward_the_evidences_chunks(monkeypatch):
    model = _model().eval()
    ids = torch.randint(0, 256, (2, 31))
    # row 0: evidence tokens 5-9 (chunks 1 and 2), answer tokens 22-25 (chunks 5 and 6): the
    # landmarks of chunks 4 and 5 made the retrievals those tokens read
    # row 1: evidence token 2 (chunk 0), answer token 30 (chunk 7): landmark 6
    targets = _targets(2, 31, {0: (5, 10), 1: (2, 3)}, {0: (22, 26), 1: (30, 31)})
    seen = _capture(monkeypatch)
    out = model(ids, retrieval_targets=targets)
    assert len(seen) == 2  # one per group
    asking, evidence = seen[0]
    assert asking.shape == (2, 8) and evidence.shape == (2, 8, 8)
    assert asking[0].nonzero().flatten().tolist() == [4, 5] and asking[1].nonzero().flatten().tolist() == [6]
    for i in (4, 5):
        assert evidence[0, i].nonzero().flatten().tolist() == [1, 2]
    assert evidence[1, 6].nonzero().flatten().tolist() == [0]
    assert not evidence[0, [0, 1, 2, 3, 6, 7]].any() and not evidence[1, [0, 1, 2, 3, 4, 5, 7]].any()
    assert torch.isfinite(out.retrieval_loss) and float(out.retrieval_loss.detach()) > 0


def test_found_is_the_share_of_supervised_retrievals_that_read_the_evidences_chunks():
    model = _model().eval()
    ids = torch.randint(0, 256, (3, 40))
    targets = _targets(3, 40, {0: (1, 3), 1: (9, 10), 2: (13, 18)}, {0: (36, 40), 1: (30, 31), 2: (25, 28)})
    out = model(ids, retrieval_targets=targets, return_retrieval=True)
    hits = total = 0
    for indices in out.retrieval.indices:  # [B, n, K] per group: row t made by landmark t
        for row, landmarks, wanted in [(0, [8], {0}), (1, [6], {2}), (2, [5], {3, 4})]:
            for t in landmarks:
                total += 1
                hits += len(wanted & set(indices[row, t].tolist())) >= min(len(wanted), 2)  # top_k 2
    assert float(out.retrieval_found) == pytest.approx(hits / total)


def test_targets_change_neither_the_logits_nor_the_language_models_loss():
    for train in (False, True):
        model = _model().train(train)
        ids = torch.randint(0, 256, (2, 27))
        targets = _targets(2, 27, {0: (1, 4), 1: (2, 3)}, {0: (20, 24), 1: (25, 27)})
        torch.manual_seed(1)  # the Gumbel noise of training
        plain = model(ids, labels=ids)
        torch.manual_seed(1)
        supervised = model(ids, labels=ids, retrieval_targets=targets)
        torch.testing.assert_close(supervised.logits, plain.logits, rtol=0, atol=0)
        torch.testing.assert_close(supervised.loss, plain.loss, rtol=0, atol=0)
        assert plain.retrieval_loss is None and supervised.retrieval_loss is not None


def test_the_loss_trains_the_retriever_and_what_feeds_it():
    model = _model().train()
    ids = torch.randint(0, 256, (2, 33))
    targets = _targets(2, 33, {0: (1, 4), 1: (5, 7)}, {0: (28, 32), 1: (24, 26)})
    model(ids, retrieval_targets=targets).retrieval_loss.backward()
    for name in ("query_proj.0.weight", "query_proj.1.weight", "landmark_key.weight", "lower.0.mlp.down.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name


def test_with_nothing_to_find_the_loss_is_zero_and_found_is_nan():
    model = _model().eval()
    ids = torch.randint(0, 256, (1, 20))
    # the evidence sits in the answer's own chunk: inside the window, no candidate
    out = model(ids, retrieval_targets=_targets(1, 20, {0: (16, 17)}, {0: (18, 20)}))
    assert float(out.retrieval_loss.detach()) == 0.0 and torch.isnan(out.retrieval_found)
    short = model(torch.randint(0, 256, (1, 3)), retrieval_targets=torch.zeros(1, 3, dtype=torch.long))
    assert float(short.retrieval_loss.detach()) == 0.0


def test_packed_rows_map_each_token_to_its_documents_chunk(monkeypatch):
    model = _model().eval()
    ids = torch.randint(0, 256, (1, 18))
    # documents of 6 and 12 tokens: chunks 0-1 and 2-4 on the packed grid
    documents = torch.tensor([[0] * 6 + [1] * 12])
    targets = _targets(1, 18, {0: (6, 7)}, {0: (17, 18)})  # evidence: document 1's token 0; answer: its token 11
    seen = _capture(monkeypatch)
    out = model(ids, document_ids=documents, retrieval_targets=targets, return_retrieval=True)
    asking, evidence = seen[0]
    assert evidence[0, 3].nonzero().flatten().tolist() == [2] and asking[0].nonzero().flatten().tolist() == [3]
    # landmark 3's only candidate in its document is chunk 2: found
    assert float(out.retrieval_found) == 1.0


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.zeros(2, 5, dtype=torch.long), r"retrieval_targets must be a tensor shaped like input_ids \(2, 9\)"),
        (torch.full((2, 9), -1), "retrieval_targets holds 0 \\(neither\\), 1 \\(evidence\\) or 2.*2p \\+ 1"),
        (torch.zeros(2, 9), "retrieval_targets holds 0"),
        ([0] * 9, r"shaped like input_ids \(2, 9\), got list"),
    ],
)
def test_bad_targets_are_refused_in_one_line(targets, message):
    with pytest.raises(InputError, match=message):
        _model()(torch.randint(0, 256, (2, 9)), retrieval_targets=targets)


def test_a_model_without_a_learned_retriever_is_refused():
    with pytest.raises(InputError, match="retrieval_targets supervise a learned retriever; .* is 'random'"):
        _model(retriever="random")(torch.randint(0, 256, (1, 9)), retrieval_targets=torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("needles", [1, 2], ids=["one-needle", "two-needles"])
@pytest.mark.parametrize("precision", ["fp64", "bf16", "autocast-bf16"])
def test_the_loss_in_other_precisions_is_close_to_fp32s_and_trains(precision, needles):
    model = _model(init_std=0.2).eval()
    ids = torch.randint(0, 256, (2, 45))
    targets = _targets(2, 45, {0: (3, 9), 1: (12, 14)}, {0: (40, 45), 1: (33, 36)})
    if needles == 2:  # a second needle in each row: evidence in chunk 4, asked from chunk 7
        targets[:, 17:19], targets[:, 29:31] = 3, 4
    reference = model(ids, retrieval_targets=targets).retrieval_loss.detach()
    if precision == "autocast-bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, retrieval_targets=targets).retrieval_loss
    else:
        model = model.to(torch.float64 if precision == "fp64" else torch.bfloat16)
        loss = model(ids, retrieval_targets=targets).retrieval_loss
    # the scores, and so the loss, are fp32 whatever the compute dtype (fp64 for fp64)
    assert loss.dtype == (torch.float64 if precision == "fp64" else torch.float32)
    tolerance = 1e-5 if precision == "fp64" else 0.05
    torch.testing.assert_close(loss.float(), reference, rtol=tolerance, atol=tolerance)
    loss.backward()
    grad = model.query_proj[0].weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0


def test_a_row_asking_about_several_needles_supervises_each_retrieval_toward_its_own(monkeypatch):
    model = _model().eval()
    ids = torch.randint(0, 256, (1, 31)).expand(2, -1).clone()
    # needle 0: evidence in chunk 1, its answer in chunk 5 (landmark 4); needle 1: evidence in
    # chunk 3, its answer in chunk 7 (landmark 6)
    both = torch.zeros(1, 31, dtype=torch.long)
    both[0, 5:6], both[0, 22:23], both[0, 13:14], both[0, 29:31] = 1, 2, 3, 4
    seen = _capture(monkeypatch)
    out = model(ids[:1], retrieval_targets=both)
    asking, evidence = seen[0]
    assert asking[0].nonzero().flatten().tolist() == [4, 6]
    assert evidence[0, 4].nonzero().flatten().tolist() == [1] and evidence[0, 6].nonzero().flatten().tolist() == [3]
    # the same as two rows of the same text, each asking about one of the needles
    apart = _targets(2, 31, {0: (5, 6), 1: (13, 14)}, {0: (22, 23), 1: (29, 31)})
    alone = model(ids, retrieval_targets=apart)
    torch.testing.assert_close(out.retrieval_loss, alone.retrieval_loss)
    torch.testing.assert_close(out.retrieval_found, alone.retrieval_found)


def test_narrow_integer_targets_with_many_needles_give_the_same_loss():
    # 120 needles on 601 chunks: 120 * 602 (needle, chunk) slots do not fit an int16
    model = _model().eval()
    length = 601 * S
    ids = torch.randint(0, 256, (1, length))
    targets = torch.zeros(1, length, dtype=torch.long)
    for p in range(120):
        targets[0, 8 * p] = 2 * p + 1  # the evidence in chunk 2p
        targets[0, 8 * p + 4 * S] = 2 * p + 2  # asked from chunk 2p + 4 (landmark 2p + 3)
    wide = model(ids, retrieval_targets=targets)
    narrow = model(ids, retrieval_targets=targets.to(torch.int16))
    torch.testing.assert_close(narrow.retrieval_loss, wide.retrieval_loss)
    torch.testing.assert_close(narrow.retrieval_found, wide.retrieval_found)
