"""Retrieval top-k: the bf16 and low-rank screens against the reference (every score in fp32/fp64).

A screened top-k must be the reference's wherever scores are not tied, including near ties far
below bf16's resolution (bf16 screen) or hidden in the dimensions outside the basis (low-rank
screen); its scores carry the same gradients.

A screen falls back to the reference where it cannot rule out enough keys; a test that says it
tests a screen asserts, through the `fallbacks` spy, that no row fell back, so that it does not
compare the reference with itself. Keys placed at the edge of each screen's error bound make a
bound that is too small drop keys of the exact top-k."""

import pytest
import torch

import farsight.ops.retrieval as retrieval_module
import farsight.ops.retrieval.groups as groups_module
import farsight.ops.retrieval.lowrank as lowrank_module
import farsight.ops.retrieval.screened as screened_module
from farsight.ops.retrieval import (
    LowRankKeys,
    retrieval_scores,
    retrieval_topk,
    retrieval_topk_lowrank,
    retrieval_topk_reference,
    retrieval_topk_screened,
)


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
    torch.testing.assert_close(
        gs.sort(-1).values[finite.all(-1)], rs.sort(-1).values[finite.all(-1)], atol=atol, rtol=0
    )


def inputs(b, m, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, m, d, generator=g, dtype=dtype), torch.randn(b, n, d, generator=g, dtype=dtype)


def correlated_inputs(b, m, n, d, dtype, seed=0):
    """Random keys and queries around one direction per batch row, as a trained model's landmark
    queries are: the queries share most of their top keys, so a screen rules out most groups
    (with unrelated random queries the union of what the queries keep is too large to rescore)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, n, d, generator=g, dtype=dtype)
    shared = torch.randn(b, 1, d, generator=g, dtype=dtype)
    return 2 * shared + 0.5 * torch.randn(b, m, d, generator=g, dtype=dtype), keys


@pytest.fixture
def fallbacks(monkeypatch):
    """The batch rows that a screen scored in full instead of screening (a spy on the reference
    that both screens fall back to): a test of the screen asserts there are none."""
    rows = []
    for module in (groups_module, screened_module, lowrank_module):

        def spy(query, *args, real=module.retrieval_topk_reference):
            rows.append(query.shape[0])
            return real(query, *args)

        monkeypatch.setattr(module, "retrieval_topk_reference", spy)
    return rows


# (n, k) a screen thins: with 7 queries, the groups they keep fit in 1/RESCORE_LIMIT of the keys
SCREENED = [(1000, 1), (4099, 1), (4099, 4), (20000, 4), (20000, 16)]


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("n, k", SCREENED)
def test_screened_topk_equals_the_reference(dtype, atol, n, k, fallbacks):
    q, keys = correlated_inputs(2, 7, n, 24, dtype)
    start = torch.tensor([0, 3])
    stop = torch.arange(7) + n - 5  # the last queries see every key, the first ones fewer
    ref = retrieval_topk_reference(q, keys, k, start, stop, 0.2)
    got = retrieval_topk_screened(q, keys, k, start, stop, 0.2)
    assert fallbacks == []  # the screen's own top-k, not the reference's
    assert_same_topk(ref, got, atol)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("n, k", [(1, 1), (5, 4), (17, 40), (100, 4), (1000, 40), (4099, 40)])
@pytest.mark.parametrize("screen", ["bf16", "lowrank"])
def test_memories_a_screen_cannot_thin_are_scored_in_full(dtype, atol, n, k, screen, fallbacks):
    """A small memory (one group is more than 1/RESCORE_LIMIT of it), or queries whose top-k
    groups together are: every batch row takes the reference's scores, with the reference's
    shapes and -inf where a query has fewer than k candidates."""
    q, keys = inputs(2, 7, n, 24 if screen == "bf16" else 64, dtype)
    start = torch.tensor([0, min(3, n)])
    stop = torch.arange(7) + max(0, n - 5)
    ref = retrieval_topk_reference(q, keys, k, start, stop, 0.2)
    if screen == "bf16":
        got = retrieval_topk_screened(q, keys, k, start, stop, 0.2)
    else:
        got = retrieval_topk_lowrank(q, keys, k, start, stop, 0.2)
    assert sum(fallbacks) == 2
    assert_same_topk(ref, got, atol)


@pytest.mark.parametrize("n, start, first_stop", [(2000, 0, 1990), (4099, 50, 2000), (3000, 2990, 2992)])
def test_screening_in_many_blocks_equals_the_reference(n, start, first_stop, monkeypatch, fallbacks):
    """Blocks of 48 keys: the padding start and the causal stops fall inside and across blocks."""
    monkeypatch.setattr(groups_module, "BLOCK_SCORES", 7 * 48)
    q, keys = correlated_inputs(1, 7, n, 24, torch.float64)
    stop = (first_stop + 13 * torch.arange(7)).clamp(max=n)
    start = torch.tensor([start])
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    got = retrieval_topk_screened(q, keys, 4, start, stop, 0.2)
    assert fallbacks == []
    assert_same_topk(ref, got, 1e-12)


def test_queries_without_candidates_get_minus_inf(fallbacks):
    q, keys = correlated_inputs(1, 3, 2000, 8, torch.float64)
    index, scores = retrieval_topk_screened(q, keys, 4, torch.tensor([10]), torch.tensor([5, 10, 12]), 1.0)
    assert fallbacks == []
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
    monkeypatch.setattr(groups_module, "retrieval_topk_reference", no_fallback)
    index, _ = retrieval_topk_screened(q, keys, 8, start, stop, 1.0)
    assert torch.equal(index.sort(-1).values, ref_index.sort(-1).values)


def test_near_ties_need_the_error_bound(monkeypatch):
    """Without any bound the screen drops keys of the exact top-k: the test above can fail."""
    q, keys = near_ties()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 8, start, stop, 1.0)
    monkeypatch.setattr(screened_module, "screen_error", lambda d: 0.0)
    monkeypatch.setattr(screened_module, "OUTPUT_ROUNDING", 0.0)
    index, _ = retrieval_topk_screened(q, keys, 8, start, stop, 1.0)
    assert not torch.equal(index.sort(-1).values, ref_index.sort(-1).values)


def ties_at_the_bf16_bound(n=4096, k=4, beyond=40):
    """Keys whose screened scores are off by nearly as much as the bf16 screen's bound allows,
    in opposite directions. q [1, 1, 64] has 32 components that bf16 rounds down by almost 2^-8
    of their value and 32 that it rounds up as much. The k "winners" lie on the first 32 and
    round down as much again, the k "losers" on the other 32 and round up: a winner scores
    4.36021 exactly, 4.32813 summed from its bf16 products and 4.3125 once that is rounded to the
    bf16 output; a loser 4.35927, 4.39146 and 4.40625. The screened order is the reverse of the
    exact one by 0.71 of the two keys' bounds added (0.066 each), so a bound 1.42 times too small
    drops the winners' groups. `beyond` keys score about 4.18 exactly: more than
    the bound below the winners, so their groups are ruled out (they hold too many keys to
    rescore: a bound twice too large falls back to scoring every key). The other keys have
    norm 3 (below the winners' and losers' 6.1, so that max |k| is theirs) and score below 3.
    Each key named has a group of 16 to itself. -> (q, keys [1, n, 64], the winners' ids)."""
    d, half = 64, 32
    g = torch.Generator().manual_seed(4)
    q = torch.full((d,), 0.125 * (1 + 2**-8), dtype=torch.float64)
    q[:half] -= 0.125 * 2**-14  # just below the midpoint between 0.125 and the next bf16: rounds down
    q[half:] += 0.125 * 2**-14  # just above it: rounds up to 0.125 (1 + 2^-7)
    steps = torch.arange(half)

    def grid(total):  # half bf16 values 1 + j / 128 in [1, 2), the j adding up to total
        return 1 + (total // half + (steps < total % half)).double() / 128

    winner = grid(336) + 2**-8 - 2**-14  # each just below the midpoint above its grid value
    loser = grid(366) - 2**-8 + 2**-14  # each just above the midpoint below its grid value
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    keys = 3 * keys / keys.norm(dim=1, keepdim=True)
    named = 2 * k + beyond
    at = torch.randperm(n // 16, generator=g)[:named] * 16 + torch.randint(16, (named,), generator=g)
    keys[at[: 2 * k]] = 0
    for i in range(k):  # the same scores, the components in other orders
        keys[at[i], :half] = winner[torch.randperm(half, generator=g)]
        keys[at[k + i], half:] = loser[torch.randperm(half, generator=g)]
    along = q / q.norm()
    for j in at[2 * k :]:
        side = torch.randn(d, generator=g, dtype=torch.float64)
        side = side - (side @ along) * along
        keys[j] = 4.18 / q.norm() * along + side / side.norm()
    return q.float()[None, None], keys.float()[None], at[:k]


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0])
def test_the_bf16_bound_keeps_ties_at_its_edge_and_rules_out_what_lies_beyond(scale, monkeypatch, fallbacks):
    """With the bound as it is (scale 1) the screen returns the exact top-k from a rescoring of
    the winners' and losers' groups alone; half the bound drops the winners, twice the bound
    keeps too many groups and falls back to scoring every key."""
    q, keys, winners = ties_at_the_bf16_bound()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 4, start, stop, 1.0)
    assert sorted(ref_index[0, 0].tolist()) == sorted(winners.tolist())
    scale_the_bound(monkeypatch, screened_module, scale)
    index, _ = retrieval_topk_screened(q, keys, 4, start, stop, 1.0)
    if scale == 1.0:
        assert fallbacks == [] and sorted(index[0, 0].tolist()) == sorted(winners.tolist())
    elif scale < 1:
        assert fallbacks == [] and not set(index[0, 0].tolist()) & set(winners.tolist())
    else:
        assert fallbacks == [1]


def test_scores_too_close_to_screen_fall_back_to_scoring_every_key(monkeypatch):
    q, keys = inputs(1, 4, 2000, 16, torch.float32)
    keys = keys * 1e-3 + 1.0  # every score within the screen's error band
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 1990
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_screened(q, keys, 4, start, stop, 0.2), 2e-6)
    monkeypatch.setattr(groups_module, "retrieval_topk_reference", no_fallback)
    with pytest.raises(AssertionError, match="fell back"):
        retrieval_topk_screened(q, keys, 4, start, stop, 0.2)


@pytest.mark.parametrize("screen", ["bf16", "lowrank"])
def test_screened_scores_carry_the_reference_gradients(screen, fallbacks):
    # enough keys that the screens rule most out rather than falling back
    if screen == "bf16":
        q, keys = correlated_inputs(2, 5, 4099, 16, torch.float64)
    else:
        keys = low_rank_keys(2, 20000, 64, dtype=torch.float64)
        q = keys[:, :5] + 0.05
    start, stop = torch.tensor([0, 7]), torch.arange(5) + keys.shape[1] - 10
    grads = []
    for fn in (retrieval_topk_reference, retrieval_topk_screened if screen == "bf16" else retrieval_topk_lowrank):
        qq, kk = q.clone().requires_grad_(), keys.clone().requires_grad_()
        index, scores = fn(qq, kk, 3, start, stop, 0.3)
        order = index.argsort(-1)
        (scores.gather(-1, order) * torch.arange(1.0, 4.0, dtype=torch.float64)).sum().backward()
        grads.append((qq.grad, kk.grad))
    assert fallbacks == []
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_score_in_fp32(dtype, fallbacks):
    q, keys = correlated_inputs(1, 9, 4000, 32, torch.float32)
    q, keys = q.to(dtype), keys.to(dtype)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(9) + 3990
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    got = retrieval_topk_screened(q, keys, 4, start, stop, 0.2)
    assert got[1].dtype == torch.float32 and fallbacks == []
    assert_same_topk(ref, got, 1e-5)


def test_under_autocast_bf16_the_scores_stay_fp32(fallbacks):
    q, keys = correlated_inputs(1, 4, 4000, 32, torch.float32)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 3900
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = retrieval_topk(q, keys, 4, start, stop, 0.2, backend="screened")
        scores = retrieval_scores(q, keys, start, stop, 0.2)
    assert got[1].dtype == scores.dtype == torch.float32 and fallbacks == []
    assert_same_topk(ref, got, 2e-6)


def test_given_bf16_keys_and_norm_bound_are_used(monkeypatch, fallbacks):
    q, keys = correlated_inputs(1, 4, 4000, 32, torch.float32)
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(4) + 3900
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    keys_low, bound = keys.bfloat16(), keys.norm(dim=-1).max() * 1.5
    screened, bounds = [], []
    maxima, topk = screened_module.group_maxima, screened_module.topk_from_groups
    monkeypatch.setattr(
        screened_module,
        "group_maxima",
        lambda q, keys, *rest: screened.append(keys.data_ptr()) or maxima(q, keys, *rest),
    )
    monkeypatch.setattr(
        screened_module, "topk_from_groups", lambda *args: bounds.append(args[3].min().item()) or topk(*args)
    )
    got = retrieval_topk(q, keys, 4, start, stop, 0.2, keys_low, bound, backend="screened")
    assert screened == [keys_low.data_ptr()] and fallbacks == []
    # the bound's constant term is screen_error * |q| * max_key_norm: 1.5 times that of the keys' own norm
    own = screened_module.screen_error(32) * (0.2 * q[0].norm(dim=-1)).min() * keys.norm(dim=-1).max()
    assert bounds[0] > 1.4 * own
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
    index, scores = retrieval_topk(
        q, keys, 4, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1.0, backend="screened"
    )
    assert index.shape == scores.shape == (2, 3, 0)
    q, keys = inputs(1, 0, 2000, 8, torch.float32)
    index, scores = retrieval_topk(
        q, keys, 4, torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1.0, backend="screened"
    )
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
    args = dict(
        query=torch.zeros(1, 3, 8),
        keys=torch.zeros(1, 5, 8),
        k=2,
        start=torch.zeros(1, dtype=torch.long),
        stop=torch.arange(3),
        scale=1.0,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        retrieval_topk(**args)


@pytest.mark.parametrize("native", [True, False])
def test_auto_takes_the_low_rank_screen_where_the_keys_have_a_basis_else_bf16_where_native(native, monkeypatch):
    """Where bf16 is native the low-rank screen takes over from the bf16 one at
    LOW_RANK_OVER_BF16_KEYS keys (here set to n): at n - 1 keys the bf16 screen runs."""
    calls = []

    def screen(name):
        def run(*args):
            calls.append((name, args[1].shape[1]))
            return retrieval_topk_reference(*args[:6])

        return run

    monkeypatch.setattr(retrieval_module, "native_bf16_matmul", lambda device: native)
    monkeypatch.setattr(retrieval_module, "retrieval_topk_screened", screen("bf16"))
    monkeypatch.setattr(retrieval_module, "retrieval_topk_lowrank", screen("lowrank"))
    n = retrieval_module.SCREEN_MIN_KEYS + 1
    monkeypatch.setattr(retrieval_module, "LOW_RANK_OVER_BF16_KEYS", n)
    q, keys = inputs(1, 3, n, 64, torch.float32)
    low_rank = LowRankKeys()
    low_rank.update(low_rank_keys(1, n, 64))
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(3) + 1000
    ref = retrieval_topk_reference(q, keys, 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk(q, keys, 4, start, stop, 0.2), 0)  # no LowRankKeys given
    retrieval_topk(q, keys, 4, start, stop, 0.2, low_rank=low_rank)
    retrieval_topk(q, keys[:, :100], 4, start, stop - 920, 0.2, low_rank=low_rank)  # a short memory is never screened
    full_rank = LowRankKeys()
    full_rank.update(keys)  # random keys: no low-rank basis
    assert full_rank.basis is None
    retrieval_topk(q, keys, 4, start, stop, 0.2, low_rank=full_rank)
    retrieval_topk(q, keys[:, :-1], 4, start, stop, 0.2, low_rank=low_rank)  # one key short of the takeover
    if native:
        assert calls == [("bf16", n), ("lowrank", n), ("bf16", n), ("bf16", n - 1)]
    else:
        assert calls == [("lowrank", n), ("lowrank", n - 1)]


def low_rank_keys(b, n, d, rank=5, noise=1e-3, dtype=torch.float32, seed=0):
    """Keys like a trained DRT's: a large common part, `rank` directions and a little noise."""
    g = torch.Generator().manual_seed(seed)
    mean = 3 * torch.randn(b, 1, d, generator=g, dtype=torch.float64)
    directions = torch.linalg.qr(torch.randn(b, d, rank, generator=g, dtype=torch.float64)).Q.transpose(1, 2)
    coefficients = torch.randn(b, n, rank, generator=g, dtype=torch.float64) * torch.linspace(
        2, 0.5, rank, dtype=torch.float64
    )
    keys = mean + coefficients @ directions + noise * torch.randn(b, n, d, generator=g, dtype=torch.float64)
    return keys.to(dtype)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])  # scores near 100
@pytest.mark.parametrize("n, k", SCREENED)
def test_low_rank_topk_equals_the_reference_without_scoring_every_key(dtype, atol, n, k, fallbacks):
    keys = low_rank_keys(2, n, 64, dtype=dtype)
    # queries around one key, as trained ones lie near the keys and near each other
    q = 0.3 * inputs(2, 6, 0, 64, dtype, seed=3)[0] + keys[:, :1]
    start, stop = torch.tensor([0, 37]), (n - 6 * 97) + 97 * torch.arange(6)
    low_rank = LowRankKeys()
    low_rank.update(keys)
    assert low_rank.basis.shape == (2, 8, 64)
    ref = retrieval_topk_reference(q, keys, k, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_lowrank(q, keys, k, start, stop, 0.2, low_rank), atol)
    assert_same_topk(ref, retrieval_topk_lowrank(q, keys, k, start, stop, 0.2), atol)  # fitted on the fly
    assert fallbacks == []


def order_hidden_outside_the_basis(n=20000, d=64, close=16, gap=0.05):
    """Low-rank keys and a query q = u + side (u in the keys' span, side orthogonal to it): `close`
    keys score 100 + gap * p_i inside the span (p a permutation of 0..close-1) and -2 gap * p_i
    along side, too little energy to enter the fitted basis, so their exact scores 100 - gap * p_i
    run in the opposite order to what the basis sees; every other key scores below 60."""
    keys = low_rank_keys(1, n, d, rank=7, noise=0.0, dtype=torch.float64)[
        0
    ]  # mean + 7: no spare dimension in a rank-8 basis
    g = torch.Generator().manual_seed(2)
    span = torch.linalg.svd(keys, full_matrices=False).Vh[:8]
    u = span[0]
    side = torch.randn(d, generator=g, dtype=torch.float64)
    side = side - span.t() @ (span @ side)
    side = side / side.norm()
    chosen = torch.randperm(n, generator=g)[:close]
    rank = torch.randperm(close, generator=g).double()
    keys[chosen] += (100 + gap * rank - keys[chosen] @ u)[:, None] * u - (2 * gap * rank)[:, None] * side
    return (u + side)[None, None].float(), keys[None].float()


def test_low_rank_order_outside_the_basis_is_kept_by_the_residual_bound(monkeypatch):
    q, keys = order_hidden_outside_the_basis()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 8, start, stop, 1.0)
    low_rank = LowRankKeys()
    low_rank.update(keys)
    assert low_rank.basis.shape == (1, 8, 64)
    monkeypatch.setattr(groups_module, "retrieval_topk_reference", no_fallback)
    index, _ = retrieval_topk_lowrank(q, keys, 8, start, stop, 1.0, low_rank)
    assert torch.equal(index.sort(-1).values, ref_index.sort(-1).values)
    # the residual bound is what keeps them: without it the screen drops keys of the exact top-k
    low_rank.residuals.view().zero_()
    index, _ = retrieval_topk_lowrank(q, keys, 8, start, stop, 1.0, low_rank)
    assert not torch.equal(index.sort(-1).values, ref_index.sort(-1).values)


def ties_at_the_low_rank_bound(n=20000, d=64, k=4, beyond=80):
    """Low-rank keys and q = u + side as above, with keys where the low-rank bound |q_perp| rho_g
    is nearly all used: k "winners" score 100 - 0.95 inside the span and +1 along side (100.05
    exactly), k "losers" 100 + 0.95 and -1 (99.95 exactly), so the screen sees the losers 1.9
    ahead against bounds of 1 each: a bound 1.06 times too small drops the winners' groups.
    `beyond` keys score 98.5 in the span and -0.4 along side (98.1 exactly): more than the bound
    below, so their groups are ruled out (too many to rescore: twice the bound falls back to
    scoring every key). Each key named has a group of 32 to itself. -> (q, keys, winners' ids)."""
    keys = low_rank_keys(1, n, d, rank=7, noise=0.0, dtype=torch.float64)[0]  # mean + 7: a rank-8 basis
    g = torch.Generator().manual_seed(5)
    span = torch.linalg.svd(keys, full_matrices=False).Vh[:8]
    u = span[0]
    side = torch.randn(d, generator=g, dtype=torch.float64)
    side = side - span.t() @ (span @ side)
    side = side / side.norm()
    named = 2 * k + beyond
    at = torch.randperm(n // 32, generator=g)[:named] * 32 + torch.randint(32, (named,), generator=g)
    inside = torch.tensor([100 - 0.95] * k + [100 + 0.95] * k + [98.5] * beyond, dtype=torch.float64)
    along = torch.tensor([1.0] * k + [-1.0] * k + [-0.4] * beyond, dtype=torch.float64)
    keys[at] += (inside - keys[at] @ u)[:, None] * u + along[:, None] * side
    return (u + side)[None, None].float(), keys[None].float(), at[:k]


def scale_the_bound(monkeypatch, module, scale):
    """Make `module`'s screen pass its error bound times `scale` to the top-k from groups."""
    real = module.topk_from_groups
    monkeypatch.setattr(
        module, "topk_from_groups", lambda q, keys, top, error, *rest: real(q, keys, top, scale * error, *rest)
    )


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0])
def test_the_low_rank_bound_keeps_ties_at_its_edge_and_rules_out_what_lies_beyond(scale, monkeypatch, fallbacks):
    q, keys, winners = ties_at_the_low_rank_bound()
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([keys.shape[1]])
    ref_index, _ = retrieval_topk_reference(q, keys, 4, start, stop, 1.0)
    assert sorted(ref_index[0, 0].tolist()) == sorted(winners.tolist())
    low_rank = LowRankKeys()
    low_rank.update(keys)
    assert low_rank.basis.shape == (1, 8, 64)  # side stays outside the basis
    scale_the_bound(monkeypatch, lowrank_module, scale)
    index, _ = retrieval_topk_lowrank(q, keys, 4, start, stop, 1.0, low_rank)
    if scale == 1.0:
        assert fallbacks == [] and sorted(index[0, 0].tolist()) == sorted(winners.tolist())
    elif scale < 1:
        assert fallbacks == [] and not set(index[0, 0].tolist()) & set(winners.tolist())
    else:
        assert fallbacks == [1]


def test_low_rank_basis_is_fitted_only_where_it_saves_work():
    assert lowrank_module.fit_basis(low_rank_keys(2, 300, 64, rank=5)).shape == (2, 8, 64)
    assert lowrank_module.fit_basis(low_rank_keys(1, 300, 64, rank=11)).shape == (1, 16, 64)
    assert lowrank_module.fit_basis(low_rank_keys(1, 300, 64, rank=17)) is None  # more than D / 4
    assert lowrank_module.fit_basis(inputs(1, 0, 300, 64, torch.float32)[1]) is None  # random keys
    assert lowrank_module.fit_basis(low_rank_keys(1, 300, 16, rank=2)) is None  # D / 4 < one step


def test_low_rank_keys_stop_refitting_past_the_limit_unless_the_keys_drift(monkeypatch, fallbacks):
    monkeypatch.setattr(lowrank_module, "REFIT_LIMIT", 2000)
    monkeypatch.setattr(lowrank_module, "DRIFT_MIN_KEYS", 500)
    keys = low_rank_keys(1, 9000, 64)
    low_rank = LowRankKeys(min_keys=1000)
    fits = []
    for stop in (1000, 2000, 4000, 5000):
        low_rank.update(keys[:, :stop])
        fits.append(low_rank.fitted_at)
    assert fits == [1000, 2000, 2000, 2000]  # no refit at 4000: past the limit, the keys did not drift
    drifted = torch.cat([keys[:, :5000], low_rank_keys(1, 4000, 64, seed=7)], dim=1)  # another subspace
    low_rank.update(drifted[:, :5400])
    assert low_rank.fitted_at == 5400 and low_rank.basis.shape == (1, 16, 64)  # refitted to both subspaces
    low_rank.update(drifted[:, :7000])
    assert low_rank.fitted_at == 5400  # the new keys lie in the basis
    q = drifted[:, 6990:6993] + 0.1
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([6000, 6990, 7000])
    ref = retrieval_topk_reference(q, drifted[:, :7000], 4, start, stop, 0.2)
    assert_same_topk(ref, retrieval_topk_lowrank(q, drifted[:, :7000], 4, start, stop, 0.2, low_rank), 1e-4)
    assert fallbacks == []
    monkeypatch.setattr(lowrank_module, "DRIFT_MIN_KEYS", 5000)  # too few new keys to judge: no refit
    low_rank = LowRankKeys(min_keys=1000)
    low_rank.update(keys[:, :2000])
    low_rank.update(drifted[:, :5400])
    assert low_rank.fitted_at == 2000


def test_low_rank_keys_grow_refit_and_truncate_like_the_memory(fallbacks):
    keys = low_rank_keys(1, 5000, 64)
    low_rank = LowRankKeys(min_keys=1024)
    fits = []
    for stop in (500, 1000, 1500, 2047, 2048, 3000, 4096, 5000):
        low_rank.update(keys[:, :stop])
        assert low_rank.n_keys == stop and low_rank.coords.length == (stop if stop >= 1024 else 0)
        fits.append(low_rank.fitted_at)
    assert fits == [0, 0, 1500, 1500, 1500, 3000, 3000, 3000]
    basis = low_rank.basis
    torch.testing.assert_close(low_rank.coords.view(), keys @ basis.transpose(1, 2))
    torch.testing.assert_close(low_rank.residuals.view(), (keys - keys @ basis.transpose(1, 2) @ basis).norm(dim=-1))
    low_rank.truncate(4000)
    assert low_rank.n_keys == low_rank.coords.length == low_rank.residuals.length == 4000
    low_rank.update(keys[:, :4500])
    assert low_rank.coords.length == 4500 and torch.equal(
        low_rank.coords.view()[:, 4000:], keys[:, 4000:4500] @ basis.transpose(1, 2)
    )
    assert low_rank.max_norm >= keys.norm(dim=-1).max()
    q = keys[:, :3] + 0.1
    start, stop = torch.zeros(1, dtype=torch.long), torch.tensor([4000, 4200, 4500])
    assert_same_topk(
        retrieval_topk_reference(q, keys[:, :4500], 4, start, stop, 0.2),
        retrieval_topk_lowrank(q, keys[:, :4500], 4, start, stop, 0.2, low_rank),
        1e-4,
    )
    assert fallbacks == []
    with pytest.raises(ValueError, match="low_rank covers 4500 keys, keys has 5000"):
        retrieval_topk_lowrank(q, keys, 4, start, stop, 0.2, low_rank)


def test_low_rank_keys_of_a_bf16_memory_cast_only_new_rows_between_refits(monkeypatch):
    """A bf16 model's memory: the same basis, coordinates and residuals as its keys cast to fp32,
    and an append between refits casts only the rows it adds (casting the whole memory on every
    append made a 16M-token prefill quadratic)."""
    keys = low_rank_keys(1, 3000, 64).bfloat16()
    cast_rows = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if self.dtype == torch.bfloat16 and self.dim() == 3:
            cast_rows.append(self.shape[1])
        return to(self, *args, **kwargs)

    bf16, fp32 = LowRankKeys(min_keys=1024), LowRankKeys(min_keys=1024)
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    for stop in (1000, 1100, 1500, 1600, 2100, 2200):
        bf16.update(keys[:, :stop])
    monkeypatch.undo()
    assert cast_rows == [
        1000,
        100,
        1100,
        400,
        100,
        500,
        100,
        2200,
    ]  # new rows, and all of them at the fits (1100, 2200)
    for stop in (1000, 1100, 1500, 1600, 2100, 2200):
        fp32.update(keys[:, :stop].float())
    assert bf16.fitted_at == fp32.fitted_at == 2200 and bf16.basis.dtype == torch.float32
    for got, want in (
        (bf16.basis, fp32.basis),
        (bf16.coords.view(), fp32.coords.view()),
        (bf16.residuals.view(), fp32.residuals.view()),
    ):
        assert torch.equal(got, want)


def test_low_rank_non_finite_keys_and_queries_take_the_reference_path(monkeypatch):
    keys = low_rank_keys(1, 1200, 64)
    q = keys[:, :3] + 0.1
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(3) + 1000
    low_rank = LowRankKeys()
    low_rank.update(keys)
    bad_q = q.clone()
    bad_q[0, 1, 0] = float("nan")
    ref_index, ref_scores = retrieval_topk_reference(bad_q, keys, 4, start, stop, 0.2)
    index, scores = retrieval_topk_lowrank(bad_q, keys, 4, start, stop, 0.2, low_rank)
    assert torch.equal(index, ref_index) and torch.equal(scores.isnan(), ref_scores.isnan())
    keys[0, 1100] = float("inf")
    low_rank.update(keys)  # the same number of keys: no new ones, the bound is unchanged
    grown = torch.cat([keys, keys[:, 1100:1101]], dim=1)
    low_rank.update(grown)
    assert low_rank.basis is None
    ref_index, _ = retrieval_topk_reference(q, grown, 4, start, stop, 0.2)
    assert torch.equal(retrieval_topk_lowrank(q, grown, 4, start, stop, 0.2, low_rank)[0], ref_index)


def test_low_rank_scores_stay_fp32_under_autocast(fallbacks):
    keys = low_rank_keys(2, 4000, 64)
    q = keys[:, :5] + 0.05
    start, stop = torch.tensor([0, 7]), torch.arange(5) + 3900
    with torch.autocast("cpu", dtype=torch.bfloat16):
        index, scores = retrieval_topk(q, keys, 3, start, stop, 0.3, backend="lowrank")
    assert scores.dtype == torch.float32 and fallbacks == []
    assert_same_topk(retrieval_topk_reference(q, keys, 3, start, stop, 0.3), (index, scores), 1e-4)


def test_low_rank_empty_memory_and_empty_queries():
    q, keys = inputs(2, 3, 0, 64, torch.float32)
    index, scores = retrieval_topk(
        q, keys, 4, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1.0, backend="lowrank"
    )
    assert index.shape == scores.shape == (2, 3, 0)
    keys = low_rank_keys(1, 2000, 64)
    index, scores = retrieval_topk(
        keys[:, :0], keys, 4, torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1.0, backend="lowrank"
    )
    assert index.shape == (1, 0, 4)
