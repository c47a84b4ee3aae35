"""Key/value caches for autoregressive decoding: a growing one and a rolling sliding-window one."""

from __future__ import annotations

import torch


class KVCache:
    """All past keys and values, [B, H, t, d] (the layout SDPA takes), in a buffer that doubles
    when full so that appending one token does not copy the whole history."""

    def __init__(self) -> None:
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H, T, d] -> all keys and values so far, [B, H, length, d] (views)."""
        new = k.shape[2]
        if self._k is None:
            capacity = max(64, 2 * new)
            self._k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            self._v = v.new_empty(self._k.shape)
        elif self.length + new > self._k.shape[2]:
            capacity = max(2 * self._k.shape[2], self.length + new)
            grown_k = self._k.new_empty(*self._k.shape[:2], capacity, self._k.shape[3])
            grown_v = self._v.new_empty(grown_k.shape)
            grown_k[:, :, : self.length] = self._k[:, :, : self.length]
            grown_v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = grown_k, grown_v
        self._k[:, :, self.length : self.length + new] = k
        self._v[:, :, self.length : self.length + new] = v
        self.length += new
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


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
