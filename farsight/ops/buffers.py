"""`GrowingBuffer`: rows appended along one dimension of a tensor whose capacity doubles when full.

Caches that grow by a few rows per decoding step (key/value caches, the CASTLE UQ-KV cache,
DRT's landmark keys) keep their rows here, so that an append copies only the new rows and the
whole history is copied O(log n) times in all rather than at every step.

Doubling still copies the whole history in the one append that overflows: at 16M tokens DRT's
landmark keys are 512K rows of 128 in bf16 (128 MB), and the append that doubles them took 39 ms,
inside a decode step of 5 ms (benchmarks/buffers.py, 2-core Xeon). Buffers whose rows are never
written after they are appended can spread that copy (`spread_growth=True`): from half capacity
on, the next storage is allocated and the history moves into it three rows per row appended,
MOVE_BLOCK rows at a time, so all but fewer than MOVE_BLOCK rows have moved by the time the
current storage is full (the slowest append then took 6 ms). The peak memory is plain
doubling's (the full storage and the rows moved into the next one), held from half capacity on
instead of for one append.
"""

from __future__ import annotations

import torch

from farsight.errors import InputError
from farsight.ops.checks import check_positive_int

MOVE_BLOCK = 256  # rows moved ahead per copy (spread growth): one-row copies cost more in calls than in bytes


class GrowingBuffer:
    """Rows appended along dimension `dim` of one storage tensor.

    With dim=1 and rows [B, n, ...], the storage is [B, capacity, ...] and `view()` is
    [B, length, ...]; with dim=2 and rows [B, H, n, d] (a key/value cache), the storage is
    [B, H, capacity, d]. Every dimension but `dim` is fixed by the first append, and so are
    the dtype and device: later rows are copied into them. The capacity starts at
    max(min_capacity, rows of the first append) and at least doubles whenever an append does
    not fit.

    `append` and `view` return views of the storage, valid until the next append that grows
    it; in-place writes to them change the stored rows, except with `spread_growth`, where a
    row may already have been moved to the next storage (module docstring): write nothing in
    place then.
    """

    def __init__(self, dim: int = 1, min_capacity: int = 16, spread_growth: bool = False) -> None:
        check_positive_int("min_capacity", min_capacity)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise InputError(f"dim must be an integer >= 0 (the dimension rows are appended along), got {dim!r}")
        self.dim = dim
        self.min_capacity = min_capacity
        self.spread_growth = spread_growth
        self.length = 0
        self._storage: torch.Tensor | None = None
        self._next: torch.Tensor | None = None  # spread_growth: the storage the rows move to
        self._moved = 0  # rows [0, _moved) of the storage are copied into _next

    @property
    def capacity(self) -> int:
        """Rows the storage holds before the next append has to grow it (0 before the first)."""
        return 0 if self._storage is None else self._storage.shape[self.dim]

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Store `rows` (any number along `dim`, 0 included) after the rows so far; return `view()`."""
        if rows.dim() <= self.dim:
            raise InputError(
                f"rows must have more than {self.dim} dimensions to be appended along dim {self.dim}, "
                f"got shape {list(rows.shape)}"
            )
        if self._storage is not None:
            stored, given = list(self._storage.shape), list(rows.shape)
            stored[self.dim] = given[self.dim] = -1
            if stored != given:
                raise InputError(
                    f"rows of shape {list(rows.shape)} do not fit a buffer of rows shaped {stored} "
                    f"(-1 = dim {self.dim}, the one appended along); append rows of one shape"
                )
        added = rows.shape[self.dim]
        end = self.length + added
        if self._storage is None or end > self.capacity:
            self._grow(rows, max(self.min_capacity, end, 2 * self.capacity))
        self._storage.narrow(self.dim, self.length, added).copy_(rows)
        self.length = end
        if self.spread_growth and 2 * end > self.capacity:
            self._move_ahead(min(end, 3 * (end - self.capacity // 2)), MOVE_BLOCK)
        return self.view()

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows (no-op when there are no more)."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise InputError(f"truncate takes a row count >= 0, got {length!r}")
        self.length = min(self.length, length)
        self._moved = min(self._moved, self.length)

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        """Move the rows so far into a new storage of at least `capacity` rows (shaped and typed
        like the current storage, or like `like` for the first append): the one `_move_ahead`
        has been filling when it is large enough."""
        if self._next is not None and self._next.shape[self.dim] >= capacity:
            self._move_ahead(self.length, 1)
            grown = self._next
        else:
            template = like if self._storage is None else self._storage
            shape = list(template.shape)
            shape[self.dim] = capacity
            grown = template.new_empty(shape)
            if self._storage is not None:
                grown.narrow(self.dim, 0, self.length).copy_(self.view())
        self._storage, self._next, self._moved = grown, None, 0

    def _move_ahead(self, stop: int, least: int) -> None:
        """Copy the rows [_moved, stop) into the next storage (twice the capacity, allocated on
        first use: its pages are touched as rows arrive) if they are `least` rows or more."""
        if self._next is None:
            shape = list(self._storage.shape)
            shape[self.dim] = 2 * self.capacity
            self._next = self._storage.new_empty(shape)
        if stop - self._moved >= least:
            part = self._storage.narrow(self.dim, self._moved, stop - self._moved)
            self._next.narrow(self.dim, self._moved, stop - self._moved).copy_(part)
            self._moved = stop

    def view(self) -> torch.Tensor | None:
        """All rows so far (length along `dim`), or None before the first append."""
        if self._storage is None:
            return None
        return self._storage.narrow(self.dim, 0, self.length)

    def nbytes(self) -> int:
        """Bytes of the stored rows (not of the spare capacity); 0 when empty."""
        rows = self.view()
        return 0 if rows is None else rows.numel() * rows.element_size()

    def clear(self) -> None:
        """Drop every row and the storage; the next append starts a new buffer."""
        self._storage = self._next = None
        self.length = self._moved = 0
