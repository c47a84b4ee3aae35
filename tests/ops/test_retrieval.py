"""Retrieval top-k: the bf16-screened path against the reference (every score in fp32/fp64).

The screened top-k must be the reference's wherever scores are not tied, including near ties far
below bf16's resolution; its scores carry the same gradients."""

import pytest
import torch

import farsight.ops.retrieval.screened as screened_module
from farsight.ops.retrieval import retrieval_scores, retrieval_topk, retrieval_topk_reference, retrieval_topk_screened


def assert_same_topk(ref, got, atol):
    """Same candidates (as sets, per query with k finite scores), same -inf pattern, close scores."""
    (ri, rs), (gi, gs) = ref, got
    assert gi.shape == ri.shape and gs.shape == rs.shape
    finite = torch.isfinite(rs)
    assert torch.equal(torch.isfinite(gs), finite)
    full = finite.all(-1)
    assert torch.equal(ri.sort(-1).values[full], gi.sort(-1).values[full])
    # where fewer than k are candidates, the finite entries name the same keys
    for r, g, f in zip(ri[~full], gi[~full], finite[~full]):
        assert set(r[f].tolist()) == set(g[f].tolist())
    torch.testing.assert_close(gs.sort(-1).values[finite.all(-1)], rs.sort(-1).values[finite.all(-1)], atol=atol, rtol=0)


def inputs(b, m, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, m, d, generator=g, dtype=dtype), torch.randn(b, n, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("n", [1, 5, 17, 100, 1000, 4099])
@pytest.mark.parametrize("k", [1, 4, 40])
def test_screened_topk_equals_the_reference(dtype, atol, n, k):
    q, keys = inputs(2, 7, n, 24, dtype)
    start = torch.tensor([0, min(3, n)])
    stop = torch.arange(7) + max(0, n - 5)  # the last queries see every key, the first ones fewer
    ref = retrieval_topk_reference(q, keys, k, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_screened(q, keys, k, start, stop, 0.2), atol)


@pytest.mark.parametrize("n, start, first_stop", [(1000, 0, 990), (4099, 50, 2000), (700, 690, 3)])
def test_screening_in_many_blocks_equals_the_reference(n, start, first_stop, monkeypatch):
    """Blocks of 48 keys: the padding start and the causal stops fall inside and across blocks."""
    monkeypatch.setattr(screened_module, "BLOCK_SCORES", 7 * 48)
    q, keys = inputs(1, 7, n, 24, torch.float64)
    stop = (first_stop + 13 * torch.arange(7)).clamp(max=n)
    start = torch.tensor([start])
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_screened(q, keys, 4, start, stop, 0.2), 1e-12)


def test_queries_without_candidates_get_minus_inf():
    q, keys = inputs(1, 3, 50, 8, torch.float64)
    index, scores = retrieval_topk_screened(q, keys, 4, torch.tensor([10]), torch.tensor([5, 10, 12]), 1.0)
    assert torch.isinf(scores[0, :2]).all()
    assert torch.isfinite(scores[0, 2, :2]).all() and torch.isinf(scores[0, 2, 2:]).all()
    assert set(index[0, 2, :2].tolist()) == {10, 11}


def near_ties(n=20000, d=64, close=64, gap=1e-4):
    """Random keys; the exact scores of `close` of them are 5 + gap * (a permutation of
    0..close-1): neighbours differ far below what bf16 resolves (~0.02 at 5) and far above
    fp32's rounding, and the keys are long, so that bf16 rounding reorders them. The other
    scores lie in [-5, 3], so the screen rules them out."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    q = q / q.norm()
    keys = 10 * torch.randn(n, d, generator=g, dtype=torch.float64)  # long keys: large bf16 rounding errors
    target = torch.rand(n, generator=g, dtype=torch.float64) * 8 - 5
    target[torch.randperm(n, generator=g)[:close]] = 5 + gap * torch.randperm(close, generator=g).double()
    keys = keys + (target - keys @ q)[:, None] * q
    return q[None, None].float(), keys[None].float()


def no_fallback(*args, **kwargs):
    raise AssertionError("the screen fell back to scoring every key")


def test_near_ties_below_bf16_resolution_keep_the_exact_order(monkeypatch):
    q, keys = near_ties()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 8, start, stop, 1.0)
    monkeypatch.setattr(screened_module, "retrieval_topk_reference", no_fallback)
    index, _ = retrieval_topk_screened(q, keys, 8, start, stop, 1.0)
    assert torch.equal(index.sort(-1).values, ref_index.sort(-1).values)


def test_near_ties_need_the_error_bound(monkeypatch):
    """Without the bound the screen drops keys of the exact top-k: the test above can fail."""
    q, keys = near_ties()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 8, start, stop, 1.0)
    monkeypatch.setattr(screened_module, "screen_error", lambda d: 0.0)
    index, _ = retrieval_topk_screened(q, keys, 8, start, stop, 1.0)
    assert not torch.equal(index.sort(-1).values, ref_index.sort(-1).values)


def test_scores_too_close_to_screen_fall_back_to_scoring_every_key(monkeypatch):
    q, keys = inputs(1, 4, 2000, 16, torch.float32)
    keys = keys * 1e-3 + 1.0  # every score within the screen's error band
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 1990
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_screened(q, keys, 4, start, stop, 0.2), 2e-6)
    monkeypatch.setattr(screened_module, "retrieval_topk_reference", no_fallback)
    with pytest.raises(AssertionError, match="fell back"):
        retrieval_topk_screened(q, keys, 4, start, stop, 0.2)


def test_screened_scores_carry_the_reference_gradients():
    q, keys = inputs(2, 5, 300, 16, torch.float64)
    start, stop = torch.tensor([0, 7]), torch.arange(5) + 290
    grads = []
    for fn in (retrieval_topk_reference, retrieval_topk_screened):
        qq, kk = q.clone().requires_grad_(), keys.clone().requires_grad_()
        index, scores = fn(qq, kk, 3, start, stop, 0.3)
        order = index.argsort(-1)
        (scores.gather(-1, order) * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
        grads.append((qq.grad, kk.grad))
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_score_in_fp32(dtype):
    q, keys = inputs(1, 9, 2000, 32, torch.float32)
    q, keys = q.to(dtype), keys.to(dtype)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(9) + 1990
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    got = retrieval_topk_screened(q, keys, 4, start, stop, 0.2)
    assert got[1].dtype == torch.float32
    assert_same_topk(ref, got, 1e-5)


def test_under_autocast_bf16_the_scores_stay_fp32():
    q, keys = inputs(1, 4, 1500, 32, torch.float32)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 1400
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = retrieval_topk(q, keys, 4, start, stop, 0.2, backend="screened")
        scores = retrieval_scores(q, keys, start, stop, 0.2)
    assert got[1].dtype == scores.dtype == torch.float32
    assert_same_topk(ref, got, 2e-6)


def test_given_bf16_keys_and_norm_bound_are_used():
    q, keys = inputs(1, 4, 1500, 32, torch.float32)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 1400
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    got = retrieval_topk(q, keys, 4, start, stop, 0.2, keys.bfloat16(), keys.norm(dim=-1).max() * 1.5, backend="screened")
    assert_same_topk(ref, got, 2e-6)


def test_non_finite_inputs_take_the_reference_path():
    q, keys = inputs(1, 3, 1200, 16, torch.float32)
    keys[0, 5] = float("inf")
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(3) + 1000
    ref_index, ref_scores = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    index, scores = retrieval_topk_screened(q, keys, 4, start, stop, 0.2)
    assert torch.equal(index, ref_index) and torch.equal(scores.isnan(), ref_scores.isnan())


def test_empty_memory_and_empty_queries():
    q, keys = inputs(2, 3, 0, 8, torch.float32)
    index, scores = retrieval_topk(q, keys, 4, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1.0, backend="screened")
    assert index.shape == scores.shape == (2, 3, 0)
    q, keys = inputs(1, 0, 2000, 8, torch.float32)
    index, scores = retrieval_topk(q, keys, 4, torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1.0, backend="screened")
    assert index.shape == (1, 0, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(keys=torch.zeros(1, 5, 7)), "match B and D"),
        (dict(start=torch.zeros(2, dtype=torch.long)), "start must be"),
        (dict(k=0), "k must be"),
        (dict(keys_low=torch.zeros(1, 5, 8)), "keys_low must be"),
        (dict(backend="fast"), "not one of"),
    ],
)
def test_bad_inputs_name_the_problem(change, message):
    args = dict(query=torch.zeros(1, 3, 8), keys=torch.zeros(1, 5, 8), k=2, start=torch.zeros(1, dtype=torch.long), stop=torch.arange(3), scale=1.0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        retrieval_topk(**args)


@pytest.mark.parametrize("native", [True, False])
def test_auto_screens_long_memories_only_where_bf16_matmuls_are_native(native, monkeypatch):
    import farsight.ops.retrieval as retrieval

    calls = []

    def screened(*args):
        calls.append(args[1].shape[1])
        return retrieval_topk_reference(*args[:6])

    monkeypatch.setattr(retrieval, "native_bf16_matmul", lambda device: native)
    monkeypatch.setattr(retrieval, "retrieval_topk_screened", screened)
    q, keys = inputs(1, 3, retrieval.SCREEN_MIN_KEYS, 16, torch.float32)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(3) + 1000
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk(q, keys, 4, start, stop, 0.2), 0)
    retrieval_topk(q, keys[:, :100], 4, start, stop - 920, 0.2)  # a short memory is never screened
    assert calls == ([retrieval.SCREEN_MIN_KEYS] if native else [])
