"""Position encodings: rotary embeddings (RoPE, Su et al. 2021) and ALiBi slopes (Press et al. 2022)."""

from __future__ import annotations

import math

import torch
from torch import nn

from farsight.errors import InputError


def rotary_reference(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + d/2}) by angle pos * theta^(-2i/d), written as a complex product.

    x [B, T, H, d], positions [T] -> [B, T, H, d]. Computed in float64.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xd = x.to(torch.float64)
    z = torch.complex(xd[..., : d // 2], xd[..., d // 2 :]) * rot
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" layout; cos/sin tables grow on demand and are not saved."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise InputError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        # no buffers: model.to(bf16) would round the frequencies (and the angles with them)
        self._cos = self._sin = None

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [...] -> rotation angles [..., d/2] in float64."""
        exponents = (
            torch.arange(0, self.head_dim // 2, dtype=torch.float64, device=positions.device) * 2 / self.head_dim
        )
        return positions.to(torch.float64)[..., None] * self.theta**-exponents

    def _tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # a compiled block computes its tables in its graph: no cached state to guard on
            # (the first call would otherwise compile the block twice, before and after the cache)
            angles = self._angles(torch.arange(length, device=device))
            return angles.cos(), angles.sin()
        if self._cos is None or self._cos.shape[0] < length or self._cos.device != device:
            size = max(length, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            # plain tensors even when first built inside a session's inference mode: a later
            # training forward must be able to save them for backward
            with torch.inference_mode(False):
                angles = self._angles(torch.arange(size, device=device))
                self._cos, self._sin = angles.cos(), angles.sin()
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x [B, T, H, d]; the positions are offset .. offset + T - 1, or given as a tensor: [T]
        (shared by the rows) or [B, T] (per row, e.g. restarting at each packed document)."""
        t = x.shape[1]
        if isinstance(offset, torch.Tensor):
            # computed, not looked up: no read of the largest position (a sync, a graph break),
            # and the same float64 products as the tables, so the same values
            angles = self._angles(offset.to(x.device))  # [T, d/2] or [B, T, d/2]
            cos, sin = angles.cos(), angles.sin()
        else:
            cos, sin = self._tables(offset + t, x.device)
            cos, sin = cos[offset : offset + t], sin[offset : offset + t]
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos = cos.to(dtype).expand(x.shape[0], t, -1)[:, :, None, :]
        sin = sin.to(dtype).expand(x.shape[0], t, -1)[:, :, None, :]
        half = self.head_dim // 2
        xf = x.to(dtype)
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes: the geometric sequence 2^(-8 i / n) for a power-of-two n; otherwise
    those of the closest smaller power of two followed by every other slope of twice that size."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_heads < 1:
        raise InputError(f"n_heads must be >= 1, got {n_heads}")
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest)
    if closest < n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
