"""SwiGLU feed-forward block (Shazeer, 2020) as used by LLaMA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_hidden_size(d_model: int, multiple_of: int = 32) -> int:
    """LLaMA's default: 2/3 of 4 * d_model, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(x W_gate^T) * (x W_up^T)) with nn.Linear weight layouts."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.down(F.silu(gate) * up)
