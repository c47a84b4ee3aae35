"""Multi-head CASTLE attention (causal attention with lookahead keys; Song et al., 2025; docs/design.md §3).

Six projections per head (lookahead q/k/v and causal q/k/v, fused into one matmul) and W^O,
so a layer has 7 H d d_model parameters against 4 H d d_model for standard attention:
`castle_heads_for_parity` gives the head count of a CASTLE layer as large as a standard one.
RoPE rotates (Q^C, K^C) and (Q^U, K^U), never the values (docs/design.md §3.5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from farsight.errors import InputError
from farsight.layers.attention import check_no_cache
from farsight.layers.position import RotaryEmbedding
from farsight.ops.castle import CastleCache, castle_attention, castle_decode, castle_prefill
from farsight.ops.documents import document_positions


def castle_heads_for_parity(standard_heads: int) -> int:
    """Heads of a CASTLE layer with about the parameters of `standard_heads` standard heads
    (same head dim): round(4/7 H_std), at least 1. E.g. 14 -> 8, 16 -> 9 (the paper's choices)."""
    if standard_heads < 1:
        raise InputError(f"standard_heads must be >= 1, got {standard_heads}")
    return max(1, round(4 * standard_heads / 7))


class CastleLayerCache:
    """The UQ-KV cache of one CASTLE layer (None until the first tokens arrive)."""

    def __init__(self) -> None:
        self.state: CastleCache | None = None

    @property
    def length(self) -> int:
        return 0 if self.state is None else self.state.length


class CastleAttention(nn.Module):
    """CASTLE: every lookahead key absorbs all the tokens that follow it (trains with
    castle_attention, decodes with castle_prefill / castle_decode and a CastleLayerCache)."""

    positions = ("rope", "none")
    lookahead_field: str | None = None

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.window = getattr(config, self.lookahead_field) if self.lookahead_field else None
        inner = self.n_heads * self.head_dim
        self.qkv = nn.Linear(config.d_model, 6 * inner, bias=False)
        self.out = nn.Linear(inner, config.d_model, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_theta) if config.position == "rope" else None

    def new_cache(self) -> CastleLayerCache:
        return CastleLayerCache()

    def _project(self, x: torch.Tensor, offset: int | torch.Tensor) -> list[torch.Tensor]:
        """x [B, T, D] -> [qu, ku, vu, qc, kc, vc], each [B, T, H, d]."""
        b, t, _ = x.shape
        qu, ku, vu, qc, kc, vc = self.qkv(x).view(b, t, 6, self.n_heads, self.head_dim).unbind(2)
        if self.rotary is not None:
            qu, ku, qc, kc = (self.rotary(y, offset) for y in (qu, ku, qc, kc))
        return [qu, ku, vu, qc, kc, vc]

    def forward(
        self, x: torch.Tensor, cache: CastleLayerCache | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, D]; document_ids [B, T] (a packed row, no cache): each token attends only to
        its own document (and lookahead sums stay inside it), RoPE positions restart at 0."""
        b, t, _ = x.shape
        if document_ids is not None:
            check_no_cache(cache)
            positions = document_positions(document_ids) if self.rotary is not None else 0
            o = castle_attention(*self._project(x, positions), window=self.window, document_ids=document_ids)
        elif cache is None:
            o = castle_attention(*self._project(x, 0), window=self.window)
        elif cache.state is None and t > 1:
            o, cache.state = castle_prefill(*self._project(x, 0), window=self.window, layer=id(self))
        else:
            inputs = self._project(x, cache.length)
            if cache.state is None:
                # the projections' dtype, not x's: under autocast they are bf16/fp16 while x is fp32
                cache.state = CastleCache.empty(
                    b,
                    self.n_heads,
                    self.head_dim,
                    dtype=inputs[0].dtype,
                    device=x.device,
                    window=self.window,
                    layer=id(self),
                )
            # a block after a prefix is decoded token by token (Algorithm 5 per step)
            steps = []
            for i in range(t):
                o_i, _ = castle_decode(*(y[:, i : i + 1] for y in inputs), cache.state, layer=id(self))
                steps.append(o_i)
            o = torch.cat(steps, dim=1)
        return self.out(o.reshape(b, t, -1))


class CastleSWLAttention(CastleAttention):
    """CASTLE-SWL: each lookahead key absorbs only the next `lookahead_window` tokens."""

    config_fields = ("lookahead_window",)
    lookahead_field = "lookahead_window"
