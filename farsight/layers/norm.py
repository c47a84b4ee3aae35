"""RMSNorm (Zhang & Sennrich, 2019): x / rms(x) * weight, no mean subtraction, no bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The defining formula, computed in float32 (float64 stays float64)."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(normed.dtype)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        return rms_norm_reference(x, self.weight, self.eps)
