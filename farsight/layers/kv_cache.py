"""Key/value caches for autoregressive decoding: a growing one and a rolling sliding-window one."""

from __future__ import annotations

import torch

from farsight.ops.buffers import GrowingBuffer


class KVCache:
    """All past keys and values, [B, H, t, d] (the layout SDPA takes), in buffers that double
    when full so that appending one token does not copy the whole history; a token's rows are
    never rewritten, so each doubling's copy is spread over the appends before it.

    A shallow copy is a snapshot (what a causal-retrieval session keeps to undo a call): it
    shares the buffers but keeps its own `length`, and appending to it first truncates the
    buffers to that length, dropping the rows the discarded copy appended (GrowingBuffer moves
    rows written again anew)."""

    def __init__(self) -> None:
        self.length = 0
        self._k = GrowingBuffer(dim=2, min_capacity=64, spread_growth=True)
        self._v = GrowingBuffer(dim=2, min_capacity=64, spread_growth=True)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, T, d] -> all keys and values so far, [B, H, length, d] (views)."""
        self._k.truncate(self.length)
        self._v.truncate(self.length)
        self.length += k.shape[2]
        return self._k.append(k), self._v.append(v)


class SlidingKVCache:
    """The last `window - 1` keys and values, [B, t, H, d]: all a sliding-window query needs
    besides its own. `length` counts every position seen (for position offsets)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, T, H, d] -> (cached + new keys, cached + new values) for the T new queries."""
        self.length += k.shape[1]
        if self._k is not None:
            k = torch.cat([self._k, k], dim=1)
            v = torch.cat([self._v, v], dim=1)
        # clone: a view would keep a long prefill's whole key tensor alive
        start = max(0, k.shape[1] - (self.window - 1))
        self._k = k[:, start:].clone()
        self._v = v[:, start:].clone()
        return k, v
