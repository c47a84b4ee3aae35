"""Fused Triton kernels for grouped cross-attention (FlashGCA, paper Appendix B, generalised).

Differences from the paper's kernel: any S, K, Lq and head dim (tiles are padded to powers of
two and masked), softmax off by one is really applied (an implicit zero logit in every row), and
the retrieved chunks are read in place through `index` (pointer arithmetic on k/v, no gathered
copy). Nothing of size K x output is stored either: the forward keeps one logsumexp per (slot,
head, query row), and the backward recomputes each slot's probabilities and output from it.

Layout: all tensors are contiguous; a row of q / k / v holds H * d values, so head h of row r
of chunk c starts at (c * rows_per_chunk + r) * H * d + h * d.

Programs: one per (batch, query chunk, head) and block of BLOCK_Q query rows. Each loops over
its K slots, and over each retrieved chunk in tiles of BLOCK_S rows. dk/dv are accumulated with
fp32 atomics because any number of query chunks (or one chunk, twice) may retrieve the same
memory chunk; their summation order, and so their last bits, vary from run to run on GPU.

This module needs triton; `farsight.ops.gca` imports it on first use only. For CPU tensors set
TRITON_INTERPRET=1 before importing it (the kernels are created at import).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from farsight.errors import BackendUnavailableError, InputError, InputTypeError
from farsight.ops.checks import check_positive_int
from farsight.ops.precision import amp_function

__all__ = ["gca_triton", "INTERPRETED"]


@triton.jit
def _gca_fwd_kernel(
    Q,
    K,
    V,
    Index,
    Weight,
    Out,
    Lse,
    n_chunks,
    m_chunks,
    Lq,
    S,
    H,
    D,
    N_SLOTS,
    scale,
    SOFTMAX_ONE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Q/Out [B, n, Lq, H, D], K/V [B, m, S, H, D], Index/Weight [B, n, N_SLOTS], Lse [B, n, N_SLOTS, H, Lq] fp32."""
    bth = tl.program_id(0)
    h = bth % H
    bt = bth // H  # b * n + t: the query chunk (and its row of Index/Weight)
    b = bt // n_chunks
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, BLOCK_D)
    tile = tl.arange(0, BLOCK_S)
    row_ok = rows < Lq
    col_ok = cols < D
    row_stride = H * D
    # int64 offsets: a long-context memory (m * S * H * D) easily passes 2**31 elements.
    q_off = (bt.to(tl.int64) * Lq + rows[:, None]) * row_stride + h * D + cols[None, :]
    q_mask = row_ok[:, None] & col_ok[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)

    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for j in range(N_SLOTS):
        c = tl.load(Index + bt * N_SLOTS + j)
        if c >= 0:  # empty slots (-1) add nothing: skip their loads and math entirely
            w = tl.load(Weight + bt * N_SLOTS + j).to(tl.float32)
            chunk_row0 = (b.to(tl.int64) * m_chunks + c) * S
            # Online softmax over the chunk's S rows. softmax_1 has an extra logit fixed at 0:
            # start as if it had been seen (running max 0, running sum exp(0 - 0) = 1), which
            # also keeps the running max >= 0 as numerical stability requires.
            if SOFTMAX_ONE:
                m_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
                l_i = tl.full([BLOCK_Q], 1.0, dtype=tl.float32)
            else:
                m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
            o_j = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + tile < S
                kv_off = (chunk_row0 + s0 + tile[:, None]) * row_stride + h * D + cols[None, :]
                kv_mask = s_ok[:, None] & col_ok[None, :]
                k_t = tl.load(K + kv_off, mask=kv_mask, other=0.0)
                v_t = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                scores = tl.dot(q, tl.trans(k_t), input_precision=DOT_PRECISION) * scale
                # Every tile holds at least one real row, so the running max stays finite.
                scores = tl.where(s_ok[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                o_j = o_j * alpha[:, None] + tl.dot(p.to(v_t.dtype), v_t, input_precision=DOT_PRECISION)
                m_i = m_new
            acc += w * (o_j / l_i[:, None])
            lse_off = ((bt * N_SLOTS + j) * H + h) * Lq + rows
            tl.store(Lse + lse_off, m_i + tl.log(l_i), mask=row_ok)
    tl.store(Out + q_off, acc.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def _gca_bwd_kernel(
    Q,
    K,
    V,
    Index,
    Weight,
    Lse,
    dO,
    dQ,
    dK,
    dV,
    dWPart,
    n_chunks,
    m_chunks,
    Lq,
    S,
    H,
    D,
    N_SLOTS,
    scale,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ like Q; dK/dV [B, m, S, H, D] fp32, zero-initialised, accumulated atomically;
    dWPart [B, n, N_SLOTS, H, n_query_blocks] fp32, zero-initialised: per-program parts of dweight.

    No softmax_one flag: the saved logsumexp already includes the zero logit, so
    P = exp(scores - lse) is the right probability either way, and softmax_1 has softmax's
    Jacobian (its 1 is a constant): dS = P * (dP - rowsum(P * dP)).
    """
    bth = tl.program_id(0)
    h = bth % H
    bt = bth // H
    b = bt // n_chunks
    q_block = tl.program_id(1)
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, BLOCK_D)
    tile = tl.arange(0, BLOCK_S)
    row_ok = rows < Lq
    col_ok = cols < D
    row_stride = H * D
    q_off = (bt.to(tl.int64) * Lq + rows[:, None]) * row_stride + h * D + cols[None, :]
    q_mask = row_ok[:, None] & col_ok[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(dO + q_off, mask=q_mask, other=0.0)

    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for j in range(N_SLOTS):
        c = tl.load(Index + bt * N_SLOTS + j)
        if c >= 0:
            w = tl.load(Weight + bt * N_SLOTS + j).to(tl.float32)
            chunk_row0 = (b.to(tl.int64) * m_chunks + c) * S
            lse = tl.load(Lse + ((bt * N_SLOTS + j) * H + h) * Lq + rows, mask=row_ok, other=0.0)
            # Pass 1: r = rowsum(dO * o_j) = sum_s P[:, s] (dO . v_s). It is dweight's share of
            # these rows and, times w, the rowsum(P * dP) that every dS tile needs, so it must be
            # complete before pass 2 (o_j is recomputed rather than stored K times in the forward).
            r = tl.zeros([BLOCK_Q], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + tile < S
                kv_off = (chunk_row0 + s0 + tile[:, None]) * row_stride + h * D + cols[None, :]
                kv_mask = s_ok[:, None] & col_ok[None, :]
                k_t = tl.load(K + kv_off, mask=kv_mask, other=0.0)
                v_t = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                scores = tl.dot(q, tl.trans(k_t), input_precision=DOT_PRECISION) * scale
                # Padding rows/columns would give exp(0 - lse) != 0 (even inf): mask them out first.
                p = tl.exp(tl.where(row_ok[:, None] & s_ok[None, :], scores, float("-inf")) - lse[:, None])
                r += tl.sum(p * tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION), 1)
            tl.store(dWPart + ((bt * N_SLOTS + j) * H + h) * tl.num_programs(1) + q_block, tl.sum(r, 0))

            # Pass 2: this slot's output gradient is w * dO.
            for s0 in range(0, S, BLOCK_S):
                s_ok = s0 + tile < S
                kv_off = (chunk_row0 + s0 + tile[:, None]) * row_stride + h * D + cols[None, :]
                kv_mask = s_ok[:, None] & col_ok[None, :]
                k_t = tl.load(K + kv_off, mask=kv_mask, other=0.0)
                v_t = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                scores = tl.dot(q, tl.trans(k_t), input_precision=DOT_PRECISION) * scale
                p = tl.exp(tl.where(row_ok[:, None] & s_ok[None, :], scores, float("-inf")) - lse[:, None])
                dp = tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION)
                # Gradient of the unscaled q.k products (the score scale folded in).
                ds = (w * scale) * p * (dp - r[:, None])
                dq += tl.dot(ds.to(k_t.dtype), k_t, input_precision=DOT_PRECISION)
                dv_t = w * tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
                dk_t = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
                tl.atomic_add(dV + kv_off, dv_t, mask=kv_mask)
                tl.atomic_add(dK + kv_off, dk_t, mask=kv_mask)
    tl.store(dQ + q_off, dq.to(dQ.dtype.element_ty), mask=q_mask)


# Whether the kernels were created for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_gca_fwd_kernel, triton.runtime.JITFunction)


def _tile(size: int, cap: int) -> int:
    # tl.dot needs every tile dimension >= 16; larger tiles only pay off up to the cap.
    return min(cap, max(16, triton.next_power_of_2(size)))


def _check_block(name: str, value: int | None) -> None:
    check_positive_int(name, value, allow_none=True)
    if value is not None and (value < 16 or value & (value - 1)):
        raise InputError(f"{name} must be a power of two >= 16 (a tl.dot tile), got {value}")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's global setting: exact ("ieee") unless the user allowed TF32
    # with torch.set_float32_matmul_precision("high" / "medium"). Ignored for fp16/bf16.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    # The interpreter computes bf16 tl.dot wrongly, so bf16 runs in fp32 there.
    return torch.float32 if INTERPRETED and dtype == torch.bfloat16 else dtype


class _GCATriton(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        weight: torch.Tensor,
        softmax_one: bool,
        scale: float,
        blocks: tuple[int, int, int],
    ) -> torch.Tensor:
        batch, n, lq, heads, dim = q.shape
        m, s, n_slots = k.shape[1], k.shape[2], index.shape[2]
        block_q, block_s, block_d = blocks
        dtype = _kernel_dtype(q.dtype)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, weight.dtype)
        qc, kc, vc = (x.to(dtype).contiguous() for x in (q, k, v))
        index, weight = index.contiguous(), weight.float().contiguous()
        out = torch.zeros(qc.shape, dtype=dtype, device=q.device)
        lse = torch.zeros(batch, n, n_slots, heads, lq, dtype=torch.float32, device=q.device)
        grid = (batch * n * heads, triton.cdiv(lq, block_q))
        if m > 0 and out.numel() > 0:  # with no memory every slot is empty: o = 0
            with torch.cuda.device_of(q):  # launch on q's GPU (no-op on CPU)
                _gca_fwd_kernel[grid](
                    qc,
                    kc,
                    vc,
                    index,
                    weight,
                    out,
                    lse,
                    n,
                    m,
                    lq,
                    s,
                    heads,
                    dim,
                    n_slots,
                    scale,
                    SOFTMAX_ONE=softmax_one,
                    DOT_PRECISION=_dot_precision(dtype),
                    BLOCK_Q=block_q,
                    BLOCK_S=block_s,
                    BLOCK_D=block_d,
                )
        ctx.save_for_backward(qc, kc, vc, index, weight, lse)
        ctx.scale, ctx.blocks, ctx.grid = scale, blocks, grid
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, index, weight, lse = ctx.saved_tensors
        block_q, block_s, block_d = ctx.blocks
        batch, n, lq, heads, dim = q.shape
        m, s, n_slots = k.shape[1], k.shape[2], index.shape[2]
        do = grad_out.to(q.dtype).contiguous()
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        dw_part = torch.zeros(batch, n, n_slots, heads, ctx.grid[1], dtype=torch.float32, device=q.device)
        if m > 0 and q.numel() > 0:
            with torch.cuda.device_of(q):  # launch on q's GPU (no-op on CPU)
                _gca_bwd_kernel[ctx.grid](
                    q,
                    k,
                    v,
                    index,
                    weight,
                    lse,
                    do,
                    dq,
                    dk,
                    dv,
                    dw_part,
                    n,
                    m,
                    lq,
                    s,
                    heads,
                    dim,
                    n_slots,
                    ctx.scale,
                    DOT_PRECISION=_dot_precision(q.dtype),
                    BLOCK_Q=block_q,
                    BLOCK_S=block_s,
                    BLOCK_D=block_d,
                )
        q_dtype, k_dtype, v_dtype, w_dtype = ctx.dtypes
        # Empty slots were never written, so their weight gradient is exactly zero.
        dw = dw_part.sum(dim=(3, 4))
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, dw.to(w_dtype), None, None, None


def gca_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool = True,
    scale: float | None = None,
    *,
    block_q: int | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K] -> o [B, n, Lq, H, d].

    Same semantics as `gca_reference`; inputs are assumed valid (`farsight.ops.gca.gca` checks
    them). fp32, fp16 and bf16 inputs (weight in q's dtype or fp32, read as fp32); scores,
    softmax and accumulation are fp32, and fp32 dots follow torch.get_float32_matmul_precision().
    Saved for the backward: the inputs and a logsumexp [B, n, K, H, Lq]. block_q / block_s
    (powers of two >= 16) override the query-row and key-row tile sizes (default: the next power
    of two of Lq / S, at most 64).
    """
    if q.device.type != "cuda" and not INTERPRETED:
        raise BackendUnavailableError(
            f"the Triton GCA kernels need CUDA tensors, got {q.device}; use backend='torch', or set "
            "TRITON_INTERPRET=1 before farsight.ops.gca.triton is first imported to run them on CPU"
        )
    if q.dtype == torch.float64:
        raise InputTypeError("the Triton GCA kernels support fp32, fp16 and bf16, not float64; use backend='torch'")
    _check_block("block_q", block_q)
    _check_block("block_s", block_s)
    lq, s, dim = q.shape[2], k.shape[2], q.shape[4]
    blocks = (block_q or _tile(lq, 64), block_s or _tile(s, 64), _tile(dim, 1 << 30))
    scale = dim**-0.5 if scale is None else float(scale)
    return amp_function(_GCATriton, q.device.type).apply(q, k, v, index, weight, softmax_one, scale, blocks)
