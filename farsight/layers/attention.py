"""Softmax self-attention modules: causal, sliding-window and bidirectional (DRT's chunk encoder).

The causal and sliding-window ones are attention kinds (`farsight.layers.kinds` describes the
interface they follow).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from farsight.errors import InputError
from farsight.layers.kv_cache import KVCache, SlidingKVCache
from farsight.layers.position import RotaryEmbedding, alibi_slopes
from farsight.ops.checks import compute_dtype
from farsight.ops.documents import document_positions
from farsight.ops.window import sliding_window_attention


class _QKVAttention(nn.Module):
    """Shared parts of the softmax attentions: fused QKV projection, output projection, RoPE."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        inner = self.n_heads * self.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.out = nn.Linear(inner, config.d_model, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_theta) if config.position == "rope" else None

    def project(self, x: torch.Tensor, offset: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q, k, v [B, T, H, d] with RoPE applied at positions offset.. (or at the
        positions of a [B, T] tensor: `document_positions` of a packed row)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        return q, k, v


class CausalSelfAttention(_QKVAttention):
    """Standard causal attention (PyTorch SDPA: flash/memory-efficient kernels where available)."""

    positions = ("rope", "none")

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        pad: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] continuing `cache` (or from position 0). pad [B] long, optional: the
        stream positions before pad[b] are left padding, hidden from every query but their own
        (a causal-retrieval model's aligned prompt; packed rows have none). document_ids [B, T]
        (a packed row, no cache): each token attends only to its own document, whose RoPE
        positions restart at 0."""
        b, t, _ = x.shape
        if document_ids is not None:
            check_no_cache(cache)
            # causal attention is the sliding window as wide as the row; that op masks documents:
            # FlexAttention's block mask on CUDA; on a CPU, SDPA with a dense [T, T] mask (its
            # fused kernel ran forward + backward 3x faster than the banded path at T = 4096,
            # B 2, H 4, d 32, fp32, where a window as wide as the row leaves no band to skip)
            q, k, v = self.project(x, document_positions(document_ids))
            backend = "auto" if x.is_cuda else "sdpa"
            o = sliding_window_attention(q, k, v, max(t, 1), document_ids=document_ids, backend=backend)
            return self.out(o.reshape(b, t, -1))
        q, k, v = self.project(x, cache.length if cache is not None else 0)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        past = k.shape[2] - t
        real = padding_mask(pad, 0, k.shape[2])  # [B, Tk], None when no key is padding
        if real is None and (past == 0 or t == 1):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            # SDPA's is_causal aligns the mask top-left; new queries follow `past` cached keys.
            keys = torch.arange(k.shape[2], device=x.device)
            queries = past + torch.arange(t, device=x.device)[:, None]
            mask = keys <= queries  # [T, Tk]
            if real is not None:
                # a padding query keeps its own key, so that its row stays finite
                mask = mask & (real[:, None, None, :] | (keys == queries))  # [B, 1, T, Tk]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


class SlidingWindowAttention(_QKVAttention):
    """Causal attention over the last `window` positions, ALiBi (default) or RoPE positions.

    Trains in O(T * window) time and memory (farsight.ops.window) and decodes with a rolling cache.
    """

    positions = ("alibi", "rope", "none")
    config_fields = ("window",)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.window = config.window
        slopes = alibi_slopes(self.n_heads) if config.position == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def new_cache(self) -> SlidingKVCache:
        return SlidingKVCache(self.window)

    def forward(
        self,
        x: torch.Tensor,
        cache: SlidingKVCache | None = None,
        pad: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] continuing `cache` (or from position 0). pad [B] long, optional: the
        stream positions before pad[b] are left padding, hidden from the real positions' keys.
        document_ids [B, T] (a packed row, no cache): each token attends only to its own
        document, whose RoPE positions restart at 0 (ALiBi needs no change: it is relative)."""
        b, t, _ = x.shape
        if document_ids is not None:
            check_no_cache(cache)
        offset = 0 if cache is None else cache.length
        if document_ids is not None and self.rotary is not None:
            offset = document_positions(document_ids)
        q, k, v = self.project(x, offset)
        if cache is not None:
            k, v = cache.append(k, v)
        end = cache.length if cache is not None else t
        o = sliding_window_attention(
            q,
            k,
            v,
            self.window,
            self.alibi_slopes,
            key_padding_mask=padding_mask(pad, end - k.shape[1], end),
            document_ids=document_ids,
        )
        return self.out(o.reshape(b, t, -1))


def check_no_cache(cache: object) -> None:
    """Packed documents are a training (cacheless) forward: a decoding cache holds one stream."""
    if cache is not None:
        raise InputError(
            "document_ids cannot be combined with decoding caches: a cache continues one stream; "
            "decode each document in a session of its own"
        )


def padding_mask(pad: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Keys at stream positions [start, end) -> [B, end - start] bool, True where position >= pad[b]
    (a real token); None when no key is padding."""
    if pad is None or start >= int(pad.max()):
        return None
    return torch.arange(start, end, device=pad.device) >= pad[:, None]


class BidirectionalAttention(_QKVAttention):
    """Unmasked attention within a sequence (DRT's chunk encoder), RoPE at positions 0..T-1."""

    def forward(
        self, x: torch.Tensor, cache: None = None, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, D]; key_padding_mask [B, T] (True = real token) hides padding keys from
        every query but the key's own (so rows of padding stay finite)."""
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.project(x, 0))
        mask = None
        if key_padding_mask is not None:
            own = torch.eye(t, dtype=torch.bool, device=x.device)
            mask = (key_padding_mask[:, None, :] | own)[:, None]  # [B, 1, T, T]
        if x.device.type == "cpu" and torch.is_grad_enabled() and x.requires_grad:
            o = attention_by_matmuls(q, k, v, mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


def attention_by_matmuls(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v for q, k, v [..., T, d] and a bool mask broadcastable to
    [..., T, T] (True = attend), as F.scaled_dot_product_attention computes it: two matmuls in the
    inputs' dtype and the softmax in fp32 (fp64 for fp64), autograd through plain ops.

    For training DRT's chunk encoder on the CPU: over many short sequences (B x n chunks of
    S + 1 tokens) SDPA's CPU kernel ran forward + backward 4.3x slower in bf16 (151 against 35 ms
    for 256 sequences x 4 heads x 65 tokens x d 64, a development A/B; 1.2x in fp32), nearly all
    of it in its backward; its forward alone is the faster one, so inference keeps it.
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)).to(compute_dtype(q.dtype))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
