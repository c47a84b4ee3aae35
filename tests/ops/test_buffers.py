"""GrowingBuffer: views equal the concatenation of the appended rows across capacity growth."""

from __future__ import annotations

import pytest
import torch

from farsight.ops import buffers
from farsight.ops.buffers import GrowingBuffer


def test_empty_buffer():
    buffer = GrowingBuffer()
    assert buffer.view() is None
    assert buffer.length == 0
    assert buffer.nbytes() == 0
    assert buffer.capacity == 0


@pytest.mark.parametrize("dim,shape", [(1, (2, 0, 3)), (2, (2, 3, 0, 4)), (0, (0, 5))])
def test_views_equal_concatenation_across_growth(dim, shape):
    buffer = GrowingBuffer(dim=dim, min_capacity=4)
    gen = torch.Generator().manual_seed(0)
    appended = []
    capacities = []
    for n in (1, 2, 0, 1, 3, 11, 1, 1):
        rows_shape = list(shape)
        rows_shape[dim] = n
        rows = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
        appended.append(rows)
        view = buffer.append(rows)
        want = torch.cat(appended, dim=dim)
        assert torch.equal(view, want)
        assert torch.equal(buffer.view(), want)
        assert buffer.length == want.shape[dim]
        assert buffer.nbytes() == want.numel() * 8
        capacities.append(buffer.capacity)
    # 4 (minimum) -> 8 (doubled) -> 18 (one append larger than double) -> 36 (doubled)
    assert capacities == [4, 4, 4, 4, 8, 18, 36, 36]


def test_appended_rows_are_copied():
    buffer = GrowingBuffer(dim=2)
    rows = torch.zeros(1, 2, 3, 4)
    buffer.append(rows)
    rows += 1
    assert buffer.view().abs().max() == 0


def test_zero_row_first_append_fixes_the_row_shape():
    buffer = GrowingBuffer(dim=2, min_capacity=8)
    empty = buffer.append(torch.zeros(1, 2, 0, 4, dtype=torch.float16))
    assert empty.shape == (1, 2, 0, 4) and empty.dtype == torch.float16
    assert buffer.capacity == 8 and buffer.nbytes() == 0
    with pytest.raises(ValueError, match=r"do not fit a buffer of rows shaped \[1, 2, -1, 4\]"):
        buffer.append(torch.zeros(1, 3, 1, 4))


def test_clear():
    buffer = GrowingBuffer()
    buffer.append(torch.ones(2, 5, 3))
    buffer.clear()
    assert buffer.view() is None and buffer.length == 0 and buffer.nbytes() == 0
    assert torch.equal(buffer.append(torch.zeros(1, 2)), torch.zeros(1, 2))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min_capacity must be an integer >= 1"):
        GrowingBuffer(min_capacity=0)
    with pytest.raises(ValueError, match="dim must be an integer >= 0"):
        GrowingBuffer(dim=-1)
    with pytest.raises(ValueError, match="more than 2 dimensions"):
        GrowingBuffer(dim=2).append(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="truncate takes a row count >= 0, got -1"):
        GrowingBuffer().truncate(-1)


@pytest.mark.parametrize("sizes", [(1,) * 40, (3, 1, 0, 2, 5, 1, 1, 7, 2, 1, 30, 1, 2)])
def test_spread_growth_keeps_the_views_of_plain_doubling(sizes):
    plain, spread = GrowingBuffer(dim=1, min_capacity=4), GrowingBuffer(dim=1, min_capacity=4, spread_growth=True)
    gen = torch.Generator().manual_seed(0)
    for step, n in enumerate(sizes):
        rows = torch.randn(2, n, 3, generator=gen)
        assert torch.equal(spread.append(rows), plain.append(rows))
        assert spread.capacity == plain.capacity and spread.nbytes() == plain.nbytes()
        if step == 6:
            plain.truncate(plain.length - 2)
            spread.truncate(spread.length - 2)
            assert torch.equal(spread.view(), plain.view())


def test_spread_growth_has_moved_the_history_when_the_storage_fills(monkeypatch):
    # one row per append: no append that overflows the storage copies the history at once
    monkeypatch.setattr(buffers, "MOVE_BLOCK", 4)
    buffer = GrowingBuffer(dim=1, min_capacity=16, spread_growth=True)
    rows = torch.arange(256.0).view(1, 256, 1)
    for i in range(256):
        if buffer.length == buffer.capacity and i:
            assert buffer.length - buffer._moved < 4  # the next storage holds all but < MOVE_BLOCK rows
            next_storage = buffer._next
            buffer.append(rows[:, i : i + 1])
            assert buffer._storage is next_storage
        else:
            buffer.append(rows[:, i : i + 1])
        assert buffer._moved <= buffer.length
    assert torch.equal(buffer.view(), rows)


def test_spread_growth_rewrites_truncated_rows():
    # rows moved ahead and then truncated are moved again once rewritten
    buffer = GrowingBuffer(dim=1, min_capacity=4, spread_growth=True)
    buffer.append(torch.ones(1, 4))
    buffer.truncate(1)
    assert buffer._moved <= 1
    buffer.append(torch.full((1, 3), 2.0))
    buffer.append(torch.full((1, 1), 3.0))
    assert torch.equal(buffer.view(), torch.tensor([[1.0, 2.0, 2.0, 2.0, 3.0]]))
    buffer.clear()
    assert buffer.view() is None and buffer._next is None
