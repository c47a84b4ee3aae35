"""`add_neighbors` (docs/design.md §2.8) against a loop over the retrievals that says the rule in
words: the retrieved chunks first, then per offset each one's neighbor, read only where it is a
candidate and not read already, weighed as the chunk it neighbors."""

from __future__ import annotations

import pytest
import torch

from farsight.ops.retrieval import add_neighbors, neighbor_offsets


def neighbors_by_loop(index, weight, before, after, low, high):
    b, m, k = index.shape
    width = k * (1 + before + after)
    out_index = torch.full((b, m, width), -1, dtype=torch.long)
    out_weight = torch.zeros(b, m, width, dtype=weight.dtype)
    for row in range(b):
        for i in range(m):
            seen = set()
            slot = 0
            for offset in [0, *neighbor_offsets(before, after)]:
                for j in range(k):
                    chunk = int(index[row, i, j])
                    near = chunk + offset
                    if chunk >= 0 and (offset == 0 or low[row, i] <= near < high[row, i]) and near not in seen:
                        seen.add(near)
                        out_index[row, i, slot] = near
                        out_weight[row, i, slot] = weight[row, i, j]
                    slot += 1
    return out_index, out_weight


def random_retrieval(b, m, n, k, seed):
    """Retrievals of m queries over n chunks: query i's candidates are [low, high), its K choices
    distinct candidates (fewer when there are fewer: -1, weight 0)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 3, (b, 1), generator=g).expand(b, m).clone()
    high = torch.randint(0, n + 1, (b, m), generator=g)
    index = torch.full((b, m, k), -1, dtype=torch.long)
    weight = torch.zeros(b, m, k, dtype=torch.float64)
    for row in range(b):
        for i in range(m):
            candidates = torch.arange(int(low[row, i]), max(int(low[row, i]), int(high[row, i])))
            chosen = candidates[torch.randperm(len(candidates), generator=g)[:k]]
            index[row, i, : len(chosen)] = chosen
            weight[row, i, : len(chosen)] = torch.softmax(torch.randn(len(chosen), generator=g, dtype=torch.float64), 0)
    return index, weight, low, high


@pytest.mark.parametrize(("before", "after"), [(0, 0), (1, 0), (0, 1), (1, 1), (2, 3)])
@pytest.mark.parametrize(("b", "m", "n", "k"), [(2, 7, 9, 2), (1, 5, 4, 3), (3, 11, 13, 1)])
def test_neighbors_equal_the_loop(before, after, b, m, n, k):
    index, weight, low, high = random_retrieval(b, m, n, k, seed=before * 10 + after + n)
    got_index, got_weight = add_neighbors(index, weight, before, after, low, high)
    want_index, want_weight = neighbors_by_loop(index, weight, before, after, low, high)
    assert torch.equal(got_index, want_index)
    torch.testing.assert_close(got_weight, want_weight, rtol=0, atol=0)


def test_a_neighbor_is_read_once_and_only_among_the_candidates():
    # query 0 retrieved chunks 3 and 4 among [1, 6); query 1 chunk 1 among [1, 3)
    index = torch.tensor([[[3, 4], [1, -1]]])
    weight = torch.tensor([[[0.75, 0.25], [1.0, 0.0]]], dtype=torch.float64)
    low, high = torch.tensor([[1, 1]]), torch.tensor([[6, 3]])
    got_index, got_weight = add_neighbors(index, weight, 1, 1, low, high)
    # 3's neighbor before is 2; 4's before is 3 (read already); 3's after is 4 (read already); 4's after is 5
    assert got_index.tolist() == [[[3, 4, 2, -1, -1, 5], [1, -1, -1, -1, 2, -1]]]
    assert got_weight.tolist() == [[[0.75, 0.25, 0.75, 0.0, 0.0, 0.25], [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]]]


def test_the_weights_of_neighbors_carry_gradient_to_the_retrieved_chunks_weight():
    index = torch.tensor([[[2, 5]]])
    weight = torch.tensor([[[0.6, 0.4]]], dtype=torch.float64, requires_grad=True)
    _, wide = add_neighbors(index, weight, 0, 1, torch.tensor([[0]]), torch.tensor([[6]]))
    (wide * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
    # slots: 2, 5, 3 (2's neighbor, weight 0.6), 6 (outside [0, 6): dropped)
    assert weight.grad.tolist() == [[[1.0 + 3.0, 2.0]]]


@pytest.mark.parametrize("shape", [(2, 0, 2), (2, 3, 0), (0, 3, 2)])
def test_empty_retrievals(shape):
    index = torch.full(shape, -1, dtype=torch.long)
    weight = torch.zeros(shape)
    low = torch.zeros(shape[:2], dtype=torch.long)
    got_index, got_weight = add_neighbors(index, weight, 1, 2, low, low + 4)
    assert got_index.shape == got_weight.shape == (*shape[:2], shape[2] * 4)
    assert bool((got_index == -1).all()) and not bool(got_weight.any())


def test_no_neighbors_returns_the_retrieval_itself():
    index, weight, low, high = random_retrieval(2, 4, 6, 2, seed=0)
    assert add_neighbors(index, weight, 0, 0, low, high) == (index, weight)
    assert neighbor_offsets(2, 1) == [-1, -2, 1]
