"""CASTLE inference path: the UQ-KV cache (`CastleCache`), the prefill that builds it from a
prompt (Algorithm 4) and the decode step that adds one token (Algorithm 5; SPEC 3.4).

`prefill` and `decode` assume valid inputs: `farsight.ops.castle.castle_prefill` and
`castle_decode` check them (and the cache's configuration) before calling them. Neither builds
an autograd graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from farsight.ops.buffers import GrowingBuffer
from farsight.ops.castle.blockwise import forward_with_lookahead_keys
from farsight.ops.checks import check_positive_int, compute_dtype

DEFAULT_CAPACITY = 16


class CastleCache:
    """UQ-KV cache of one CASTLE layer (Section 2.4 of the paper).

    Per token s of the t = `length` cached ones it holds, each as [B, H, t, d] rows: u[s] the
    lookahead key of s after t tokens (the last row is zero: no token follows yet), qu[s] the
    lookahead query, kc[s] / vc[s] the causal key and value. The rows are in the compute dtype
    (fp32 for fp16/bf16/fp32 inputs, fp64 for fp64) so that U, which is updated in place at
    every step, does not accumulate low-precision rounding; `input_dtype` is the dtype the cache
    accepts and returns. The buffers double when full (`GrowingBuffer`), so a decode step
    copies nothing in the common case.

    `layer` is an identity tag set by the owner (any comparable value, e.g. the layer index) so
    that castle_decode can reject a cache that belongs to another layer. Build one with
    `castle_prefill` or `CastleCache.empty`; the constructor copies the given rows as they are.
    """

    def __init__(
        self,
        u: torch.Tensor,
        qu: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        *,
        window: int | None,
        scale: float,
        input_dtype: torch.dtype,
        layer: object = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """u, qu, kc, vc: [B, H, t, d] rows of t tokens (copied in, converted to the compute
        dtype of `input_dtype`); `capacity`: tokens to make room for before the first growth."""
        self.window = window
        self.scale = scale
        self.input_dtype = input_dtype
        self.layer = layer
        dtype = compute_dtype(input_dtype)
        self._u, self._qu, self._kc, self._vc = (GrowingBuffer(dim=2, min_capacity=capacity) for _ in range(4))
        with torch.no_grad():
            for buffer, rows in zip((self._u, self._qu, self._kc, self._vc), (u, qu, kc, vc)):
                buffer.append(rows.to(dtype))

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        window: int | None = None,
        scale: float | None = None,
        layer: object = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> CastleCache:
        """A cache holding no tokens yet (equivalent to castle_prefill of a length-0 prompt)."""
        for name, value in (("batch", batch), ("heads", heads), ("head_dim", head_dim), ("capacity", capacity)):
            check_positive_int(name, value)
        check_positive_int("window", window, allow_none=True)
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        no_rows = torch.zeros(batch, heads, 0, head_dim, dtype=compute_dtype(dtype), device=device)
        return cls(
            no_rows, no_rows, no_rows, no_rows,
            window=window, scale=scale, input_dtype=dtype, layer=layer, capacity=capacity,
        )

    @property
    def u(self) -> torch.Tensor:
        """Lookahead keys [B, H, length, d] (a view into the buffer)."""
        return self._u.view()

    @property
    def qu(self) -> torch.Tensor:
        """Lookahead queries [B, H, length, d] (a view into the buffer)."""
        return self._qu.view()

    @property
    def kc(self) -> torch.Tensor:
        """Causal keys [B, H, length, d] (a view into the buffer)."""
        return self._kc.view()

    @property
    def vc(self) -> torch.Tensor:
        """Causal values [B, H, length, d] (a view into the buffer)."""
        return self._vc.view()

    @property
    def length(self) -> int:
        return self._u.length

    @property
    def capacity(self) -> int:
        return self._u.capacity

    @property
    def batch(self) -> int:
        return self.u.shape[0]

    @property
    def heads(self) -> int:
        return self.u.shape[1]

    @property
    def head_dim(self) -> int:
        return self.u.shape[3]

    @property
    def device(self) -> torch.device:
        return self.u.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Valid rows (U, QU, KC, VC), each [B, H, length, d] (views into the buffers)."""
        return self.u, self.qu, self.kc, self.vc


def prefill(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    block_size: int,
    layer: object,
    backend: str,
) -> tuple[torch.Tensor, CastleCache]:
    """Algorithm 4: six [B, T, H, d] inputs -> (o [B, T, H, d], the cache after T tokens).

    backend "torch" (blockwise, `block_size` is its knob) or "triton": both return U, the
    lookahead keys after the prompt, from the forward pass that computes o.
    """
    with torch.no_grad():
        if backend == "triton":
            from farsight.ops.castle.triton import castle_prefill_triton

            out, u = castle_prefill_triton(qu, ku, vu, qc, kc, vc, window, scale)
        else:
            out, u = forward_with_lookahead_keys(qu, ku, vu, qc, kc, vc, window, scale, block_size)
        heads_first = [x.transpose(1, 2) for x in (qu, kc, vc)]  # [B, H, T, d], copied by the cache
        cache = CastleCache(u, *heads_first, window=window, scale=scale, input_dtype=qu.dtype, layer=layer)
    return out, cache


def decode(
    cache: CastleCache,
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
) -> torch.Tensor:
    """Algorithm 5: one token's six [B, 1, H, d] inputs -> o [B, 1, H, d]; updates `cache`.

    With t tokens cached, the lookahead keys of tokens max(0, t - W) .. t - 1 gain
    sigmoid(scale * qu_s . ku_t) * vu_t (older rows can no longer change under a window and are
    not touched), a zero row is appended for the new token, then
    o = softmax(scale * qc . KC - SiLU(scale * qc . U)) @ VC over all t + 1 tokens. O(t d).
    """
    dtype = cache.u.dtype
    # [B, H, 1, d] row vectors: every product below is then a (1 x d) @ (d x t) matrix product,
    # which BLAS runs at memory speed (a (t x d) @ (d x 1) batched product is several times slower).
    q_u, k_u, v_u, q_c, k_c, v_c = (x.transpose(1, 2).to(dtype) for x in (qu, ku, vu, qc, kc, vc))
    t = cache.length
    first = 0 if cache.window is None else max(0, t - cache.window)
    with torch.no_grad():
        if first < t:
            gate = torch.matmul(k_u, cache.qu[:, :, first:t].transpose(-1, -2)).mul_(cache.scale).sigmoid_()
            cache.u[:, :, first:t].addcmul_(gate.transpose(-1, -2), v_u)  # in place, in the buffer
        u = cache._u.append(torch.zeros_like(q_u))
        cache._qu.append(q_u)
        keys = cache._kc.append(k_c)
        values = cache._vc.append(v_c)
        query = q_c.mul(cache.scale)
        score = torch.matmul(query, keys.transpose(-1, -2))  # [B, H, 1, t + 1]
        score -= F.silu(torch.matmul(query, u.transpose(-1, -2)))
        out = torch.matmul(torch.softmax(score, dim=-1), values)  # [B, H, 1, d]
    return out.transpose(1, 2).to(qu.dtype)
