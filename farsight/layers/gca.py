"""Grouped cross-attention layer (GCA; Hu et al., 2025, §3.2): a layer's own query and output
projections around `farsight.ops.gca`, reading keys and values that every upper layer shares."""

from __future__ import annotations

import torch
from torch import nn

from farsight.ops.gca import gca


class GroupedCrossAttention(nn.Module):
    """Each slot of chunk t+1 attends, per head, to each of the K chunks that chunk t's landmark
    retrieved, with a softmax (or softmax_1) over that chunk's S keys; the K results are summed
    with the retrieval's fusion weights. Keys and values are the shared per-chunk projections
    (computed once per chunk, outside this layer); the layer owns W_Q and W_O only."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, softmax_one: bool = True) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.softmax_one = softmax_one
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        weight: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, n, S+1, d_model] (the query slots on the chunk grid); k, v [B, m, S, H, d];
        index [B, n, K] into the m chunks (-1 empty); weight [B, n, K]; key_mask [B, n, K, S]
        (True = real key) or None. Returns [B, n, S+1, d_model]."""
        q = self.q(x).unflatten(-1, (self.n_heads, self.head_dim))
        # weight stays fp32 (the op fuses the K per-chunk results in fp32); k, v may come in a
        # memory's storage dtype and compute in q's
        o = gca(q, k.to(q.dtype), v.to(q.dtype), index, weight, softmax_one=self.softmax_one, key_mask=key_mask)
        return self.out(o.flatten(-2))
