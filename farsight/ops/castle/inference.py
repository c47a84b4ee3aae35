"""CASTLE inference path: the UQ-KV cache (`CastleCache`), the prefill that builds it from a
prompt (Algorithm 4) and the decode step that adds one token (Algorithm 5; docs/design.md §3.4).

`prefill` and `decode` assume valid inputs: `farsight.ops.castle.castle_prefill` and
`castle_decode` check them (and the cache's configuration) before calling them. Neither builds
an autograd graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from farsight.errors import InputTypeError
from farsight.ops.buffers import GrowingBuffer
from farsight.ops.castle.blockwise import forward_with_lookahead_keys
from farsight.ops.checks import check_positive_int, compute_dtype

DEFAULT_CAPACITY = 16
# Decode steps whose updates of U are held back and then folded in by one matrix product (see
# `decode`): the held-back gates cost PENDING_STEPS floats per cached token and head.
PENDING_STEPS = 16
# A step that updates fewer rows of U than this updates them in place: holding back costs a few
# more small products per step, which only pays where U is large (benchmarks/castle.py).
HOLD_BACK_FROM_ROWS = 2048


class CastleCache:
    """UQ-KV cache of one CASTLE layer (Section 2.4 of the paper).

    Per token s of the t = `length` cached ones it holds, each as [B, H, t, d] rows: u[s] the
    lookahead key of s after t tokens (the last row is zero: no token follows yet), qu[s] the
    lookahead query, kc[s] / vc[s] the causal key and value. The rows are in the compute dtype
    (fp32 for fp16/bf16/fp32 inputs, fp64 for fp64) so that U, which is updated in place as
    tokens arrive, does not accumulate low-precision rounding; `input_dtype` is the dtype the cache
    accepts and returns. The buffers double when full (`GrowingBuffer`), so a decode step
    copies nothing in the common case.

    A decode step that updates at least HOLD_BACK_FROM_ROWS rows of U does not rewrite them: it
    keeps the new token's gates sigmoid(scale qu[s] . ku_t) (one row of `_gates`, [B, H,
    PENDING_STEPS, capacity]) and its lookahead value vu_t, adds their contribution to its own
    scores, and every PENDING_STEPS steps all held-back updates are folded into U by one matrix
    product. So such a step reads U once instead of reading and writing it and then reading it
    again. `u` and `tensors()` fold first: they always return the lookahead keys of the
    definition.

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
        self._gates: torch.Tensor | None = None  # [B, H, PENDING_STEPS, capacity], zero where unused
        self._pending_values: torch.Tensor | None = None  # [B, H, PENDING_STEPS, d]
        self._pending = 0  # held-back steps: rows [0, _pending) of the two above
        self._held_rows = slice(0, 0)  # the rows of U the held-back steps update

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
            raise InputTypeError(f"dtype must be a floating-point dtype, got {dtype}")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        no_rows = torch.zeros(batch, heads, 0, head_dim, dtype=compute_dtype(dtype), device=device)
        return cls(
            no_rows,
            no_rows,
            no_rows,
            no_rows,
            window=window,
            scale=scale,
            input_dtype=dtype,
            layer=layer,
            capacity=capacity,
        )

    @property
    def u(self) -> torch.Tensor:
        """Lookahead keys [B, H, length, d] (a view into the buffer; held-back updates folded in)."""
        self.fold_pending()
        return self._u.view()

    @property
    def pending(self) -> int:
        """Decode steps whose updates of U are held back (folded in by `fold_pending`)."""
        return self._pending

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
        return self._kc.view().shape[0]

    @property
    def heads(self) -> int:
        return self._kc.view().shape[1]

    @property
    def head_dim(self) -> int:
        return self._kc.view().shape[3]

    @property
    def device(self) -> torch.device:
        return self._kc.view().device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Valid rows (U, QU, KC, VC), each [B, H, length, d] (views into the buffers)."""
        return self.u, self.qu, self.kc, self.vc

    def fold_pending(self) -> None:
        """Add the held-back updates to U: U[s] += sum over held-back steps j of gate_j[s] vu_j."""
        if self._pending == 0:
            return
        rows = self._held_rows
        gates = self._gates[:, :, : self._pending, rows]  # [B, H, p, n]
        # a cache decoded under torch.inference_mode() holds inference tensors, which only
        # inference mode may write to, and `u` may be read after leaving it
        with torch.no_grad(), torch.inference_mode(self._gates.is_inference()):
            # in place, batched over B * H (flatten(0, 1) of these buffer slices is a view)
            u = self._u.view()[:, :, rows].flatten(0, 1)
            u.baddbmm_(gates.transpose(-1, -2).flatten(0, 1), self._pending_values[:, :, : self._pending].flatten(0, 1))
            gates.zero_()
        self._pending = 0

    def _hold_back(self, gate: torch.Tensor, value: torch.Tensor, rows: slice) -> None:
        """Hold back one step's update of U `rows`: its gates [B, H, 1, n] over those rows and its
        value [B, H, 1, d]."""
        if self._gates is None or self._gates.shape[-1] < rows.stop:  # first use, or U has grown
            b, h, _, d = self._u.view().shape
            gates = gate.new_zeros(b, h, PENDING_STEPS, self._u.capacity)
            if self._gates is None:
                self._pending_values = gate.new_zeros(b, h, PENDING_STEPS, d)
            else:
                gates[..., : self._gates.shape[-1]] = self._gates
            self._gates = gates
        slot = self._pending
        self._gates[:, :, slot : slot + 1, rows] = gate
        self._pending_values[:, :, slot : slot + 1] = value
        self._held_rows = slice(rows.start if slot == 0 else self._held_rows.start, rows.stop)
        self._pending += 1

    def _add_held_back(self, query: torch.Tensor, scores: torch.Tensor) -> None:
        """scores [B, H, 1, length] += query . (the held-back gains of each row of U)."""
        if self._pending == 0:
            return
        values = self._pending_values[:, :, : self._pending]  # [B, H, p, d]
        weights = torch.matmul(query, values.transpose(-1, -2))  # [B, H, 1, p]: query . vu_j
        held = self._held_rows
        scores[..., held] += torch.matmul(weights, self._gates[:, :, : self._pending, held])


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
    sigmoid(scale * qu_s . ku_t) * vu_t (older rows can no longer change under a window), a zero
    row is appended for the new token, then
    o = softmax(scale * qc . KC - SiLU(scale * qc . U)) @ VC over all t + 1 tokens. O(t d).

    From HOLD_BACK_FROM_ROWS rows on, the gains are held back in the cache (`CastleCache`):
    qc . U is computed as qc . U_stored plus (qc . vu_j) gate_j summed over the held-back steps
    j, and U_stored is brought up to date every PENDING_STEPS steps by one matrix product, so a
    step reads each of QU, U, KC, VC once (and the held-back gates, fewer than PENDING_STEPS
    floats per row) and writes none of them in full.
    """
    dtype = compute_dtype(cache.input_dtype)
    # [B, H, 1, d] row vectors: every product below is then a (1 x d) @ (d x t) matrix product,
    # which BLAS runs at memory speed (a (t x d) @ (d x 1) batched product is several times slower).
    q_u, k_u, v_u, q_c, k_c, v_c = (x.transpose(1, 2).to(dtype) for x in (qu, ku, vu, qc, kc, vc))
    t = cache.length
    first = 0 if cache.window is None else max(0, t - cache.window)
    with torch.no_grad():
        u = cache._u.append(torch.zeros_like(q_u))  # U_stored: without the held-back gains
        cache._qu.append(q_u)
        keys = cache._kc.append(k_c)
        values = cache._vc.append(v_c)
        if first < t:
            gate = torch.matmul(k_u * cache.scale, cache._qu.view()[:, :, first:t].transpose(-1, -2)).sigmoid_()
            if t - first >= HOLD_BACK_FROM_ROWS:
                cache._hold_back(gate, v_u, slice(first, t))
            else:
                u[:, :, first:t].addcmul_(gate.transpose(-1, -2), v_u)  # in place, in the buffer
        query = q_c * cache.scale
        score = torch.matmul(query, keys.transpose(-1, -2))  # [B, H, 1, t + 1]
        lookahead = torch.matmul(query, u.transpose(-1, -2))  # scale qc . U_stored
        cache._add_held_back(query, lookahead)
        score -= F.silu(lookahead)
        out = torch.matmul(torch.softmax(score, dim=-1), values)  # [B, H, 1, d]
        if cache.pending == PENDING_STEPS:
            cache.fold_pending()
    return out.transpose(1, 2).to(qu.dtype)
