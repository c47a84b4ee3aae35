"""Pre-norm transformer block: x += attn(norm(x)); [x += cross(norm(x))]; x += mlp(norm(x))."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from farsight.layers.kinds import build_attention
from farsight.layers.mlp import SwiGLU
from farsight.layers.norm import RMSNorm


class TransformerBlock(nn.Module):
    def __init__(self, config: Any, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = attention if attention is not None else build_attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden)

    def forward(self, x: torch.Tensor, cache: Any = None, **masks: Any) -> torch.Tensor:
        """`masks` go to the attention (e.g. `pad` of the sliding window, `key_padding_mask` of
        the bidirectional one); attentions without padding support take none."""
        x = x + self.attn(self.attn_norm(x), cache, **masks)
        return x + self.mlp(self.mlp_norm(x))
