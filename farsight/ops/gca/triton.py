"""Fused Triton kernels for grouped cross-attention (FlashGCA, paper Appendix B, generalised).

Differences from the paper's kernel: any S, K, Lq and head dim (tiles are padded to powers of
two and masked), softmax off by one is really applied (an implicit zero logit in every row),
a key mask is supported, and the retrieved chunks are read in place through `index` (pointer
arithmetic on k/v, no gathered copy). Nothing of size K x output is stored either: the forward
keeps one logsumexp per (slot, head, query row), and the backward recomputes each slot's
probabilities from it.

Layout: all tensors are contiguous; a row of q / k / v holds H * d values, so head h of row r
of chunk c starts at (c * rows_per_chunk + r) * H * d + h * d.

Programs: one per (batch, query chunk, head) and block of BLOCK_Q query rows. Each loops over
its K slots and reads each retrieved chunk in tiles of BLOCK_S rows; an empty slot (-1) runs as
a chunk of no keys with weight 0, so the loop has no branch and the compiler may prefetch the
next slot's chunk. Two layouts matter for speed:

* A chunk that fits one tile (S <= BLOCK_S, DRT's S = 64) is read once per slot: the forward
  takes a plain softmax of the tile, and the backward gets the row term rowsum(P * dP) from the
  same tile it differentiates (with several tiles it needs a first pass over the chunk for it).
* DRT's query chunks have S + 1 rows (the landmark slot), one more than a power of two. Rather
  than a second BLOCK_Q-row block holding one real row, the rows past the last full block go
  as one TAIL-row tile: in the forward the last block's program takes it after its own rows,
  reusing nothing but its registers; in the backward it is a program of its own, so that no
  program holds two sets of row tiles at once.

Any number of query chunks, or one chunk twice, may retrieve the same memory chunk, so dk/dv
gather contributions from many programs. The backward therefore runs in two kernels: the
query-major one computes dq and dweight and stores each row's term r = rowsum(P * dP); a
key-major one, one program per key tile of each memory chunk, walks the inverted index (the
slots that retrieved the chunk, sorted once per backward) and writes that tile's dk/dv once.
No atomics: the gradients have the same bits in every run.

This module needs triton; `farsight.ops.gca` imports it on first use only. For CPU tensors set
TRITON_INTERPRET=1 before importing it (the kernels are created at import).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from farsight.errors import BackendUnavailableError, InputTypeError
from farsight.ops.precision import amp_function
from farsight.ops.triton_tiles import (
    INTERPRETED,
    autotuned,
    check_block,
    dot_precision,
    kernel_dtype,
    load_rows,
    store_rows,
    tile_size,
)

__all__ = ["gca_triton", "INTERPRETED"]


@triton.jit
def _key_tile(
    K, V, KeyMask, chunk_row0, n_keys, slot, s0, S, h, D, row_stride,
    HAS_KEY_MASK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows [s0, s0 + BLOCK_S) of a retrieved chunk: k, v [BLOCK_S, BLOCK_D] (zero past n_keys:
    S, or 0 for an empty slot), and which key columns are real (inside the chunk and not masked
    out)."""
    # int64 base: a long-context memory (m * S * H * D) easily passes 2**31 elements.
    base = chunk_row0 * row_stride + h * D
    k_t = load_rows(K, base, s0, n_keys, D, row_stride, BLOCK_S, BLOCK_D)
    v_t = load_rows(V, base, s0, n_keys, D, row_stride, BLOCK_S, BLOCK_D)
    tile = s0 + tl.arange(0, BLOCK_S)
    s_ok = tile < n_keys
    if HAS_KEY_MASK:
        s_ok = s_ok & (tl.load(KeyMask + slot * S + tile, mask=s_ok, other=0) != 0)
    return k_t, v_t, s_ok


@triton.jit
def _slot(Index, Weight, slot, b, m_chunks, S):
    """Slot `slot` of the index: the first row of its chunk in K/V, its number of keys (S, or 0
    when the slot is empty) and its weight (0 when empty). An empty slot runs like a chunk of no
    keys, so the slot loop has no branch and the compiler can prefetch the next slot's keys."""
    c = tl.load(Index + slot)
    chunk_row0 = (b.to(tl.int64) * m_chunks + tl.maximum(c, 0)) * S
    w = tl.where(c >= 0, tl.load(Weight + slot).to(tl.float32), 0.0)
    return chunk_row0, tl.where(c >= 0, S, 0), w


@triton.jit
def _fwd_rows(
    Q,
    K,
    V,
    KeyMask,
    Index,
    Weight,
    Out,
    Lse,
    bt,
    b,
    h,
    row0,
    n_rows,
    m_chunks,
    Lq,
    S,
    H,
    D,
    N_SLOTS,
    scale,
    SOFTMAX_ONE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Output rows [row0, row0 + min(ROWS, n_rows)) of query chunk bt, head h, over all slots."""
    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows < row0 + n_rows
    row_stride = H * D
    q_base = bt.to(tl.int64) * Lq * row_stride + h * D
    q = load_rows(Q, q_base, row0, row0 + n_rows, D, row_stride, ROWS, BLOCK_D)

    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for j in range(N_SLOTS):
        slot = bt * N_SLOTS + j
        chunk_row0, n_keys, w = _slot(Index, Weight, slot, b, m_chunks, S)
        # Online softmax over the chunk's S rows. softmax_1 has an extra logit fixed at 0:
        # start as if it had been seen (running max 0, running sum exp(0 - 0) = 1), which
        # also keeps the running max >= 0 as numerical stability requires.
        if SOFTMAX_ONE:
            m_i = tl.zeros([ROWS], dtype=tl.float32)
            l_i = tl.full([ROWS], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS], dtype=tl.float32)
        o_j = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            k_t, v_t, s_ok = _key_tile(
                K, V, KeyMask, chunk_row0, n_keys, slot, s0, S, h, D, row_stride, HAS_KEY_MASK, BLOCK_S, BLOCK_D
            )
            scores = tl.dot(q, tl.trans(k_t), input_precision=DOT_PRECISION) * scale
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row with no real key so far (plain softmax; masked keys or an empty slot) keeps
            # max -inf: shift by 0 there so that no exp sees -inf - -inf.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - shift)
            p = tl.exp(scores - shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            o_j = o_j * alpha[:, None] + tl.dot(p.to(v_t.dtype), v_t, input_precision=DOT_PRECISION)
            m_i = m_new
        # A slot with no real key (plain softmax) reads nothing: l = 0, o = 0; an empty slot
        # has o = 0 and w = 0 either way.
        has_keys = l_i > 0
        acc += w * (o_j / tl.where(has_keys, l_i, 1.0)[:, None])
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), 0.0)
        tl.store(Lse + (slot * H + h) * Lq + rows, lse, mask=row_ok)
    store_rows(Out, q_base, row0, row0 + n_rows, D, row_stride, acc, ROWS, BLOCK_D)


@triton.jit
def _gca_fwd_kernel(
    Q,
    K,
    V,
    KeyMask,
    Index,
    Weight,
    Out,
    Lse,
    n_chunks,
    m_chunks,
    Lq,
    main_rows,
    S,
    H,
    D,
    N_SLOTS,
    scale,
    SOFTMAX_ONE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Q/Out [B, n, Lq, H, D], K/V [B, m, S, H, D], Index/Weight [B, n, N_SLOTS], KeyMask
    [B, n, N_SLOTS, S] (bool as uint8) when HAS_KEY_MASK, Lse [B, n, N_SLOTS, H, Lq] fp32.
    Rows [0, main_rows) go in blocks of BLOCK_Q; with TAIL > 0 the last block also does rows
    [main_rows, Lq) as one TAIL-row tile."""
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    bth = tl.program_id(0)
    h = bth % H
    bt = bth // H  # b * n + t: the query chunk (and its row of Index/Weight)
    b = bt // n_chunks
    block = tl.program_id(1)
    row0 = block * BLOCK_Q
    _fwd_rows(
        Q,
        K,
        V,
        KeyMask,
        Index,
        Weight,
        Out,
        Lse,
        bt,
        b,
        h,
        row0,
        tl.minimum(BLOCK_Q, main_rows - row0),
        m_chunks,
        Lq,
        S,
        H,
        D,
        N_SLOTS,
        scale,
        SOFTMAX_ONE,
        HAS_KEY_MASK,
        DOT_PRECISION,
        BLOCK_Q,
        BLOCK_S,
        BLOCK_D,
    )
    if TAIL > 0:
        if block == tl.num_programs(1) - 1:
            _fwd_rows(
                Q,
                K,
                V,
                KeyMask,
                Index,
                Weight,
                Out,
                Lse,
                bt,
                b,
                h,
                main_rows,
                Lq - main_rows,
                m_chunks,
                Lq,
                S,
                H,
                D,
                N_SLOTS,
                scale,
                SOFTMAX_ONE,
                HAS_KEY_MASK,
                DOT_PRECISION,
                TAIL,
                BLOCK_S,
                BLOCK_D,
            )


@triton.jit
def _probabilities(q, k_t, lse, row_ok, s_ok, scale, DOT_PRECISION: tl.constexpr):
    """P = exp(scale q k^T - lse), exactly 0 at padding rows and masked or padding keys."""
    scores = tl.dot(q, tl.trans(k_t), input_precision=DOT_PRECISION) * scale
    return tl.exp(tl.where(row_ok[:, None] & s_ok[None, :], scores, float("-inf")) - lse[:, None])


@triton.jit
def _bwd_rows(
    Q, K, V, KeyMask, Index, Weight, Lse, dO, dQ, dWPart, RowTerm, bt, b, h, part, row0, end, m_chunks, Lq, S, H, D,
    N_SLOTS, scale,
    HAS_KEY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
):  # fmt: skip
    """dq of query rows [row0, end) (at most ROWS) of chunk bt, head h, over all slots; per slot
    it stores the rows' term r = rowsum(P * dP) for the key-major kernel and its share of
    dweight as part `part` of dWPart."""
    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows < end
    row_stride = H * D
    q_base = bt.to(tl.int64) * Lq * row_stride + h * D
    q = load_rows(Q, q_base, row0, end, D, row_stride, ROWS, BLOCK_D)
    do = load_rows(dO, q_base, row0, end, D, row_stride, ROWS, BLOCK_D)
    dq = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for j in range(N_SLOTS):
        slot = bt * N_SLOTS + j
        chunk_row0, n_keys, w = _slot(Index, Weight, slot, b, m_chunks, S)
        lse_base = (slot * H + h) * Lq
        lse = tl.load(Lse + lse_base + rows, mask=row_ok, other=0.0)
        if ONE_TILE:
            # One tile holds the chunk: read it once, take r from it.
            k_t, v_t, s_ok = _key_tile(
                K, V, KeyMask, chunk_row0, n_keys, slot, 0, S, h, D, row_stride, HAS_KEY_MASK, BLOCK_S, BLOCK_D
            )
            p = _probabilities(q, k_t, lse, row_ok, s_ok, scale, DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION)
            r = tl.sum(p * dp, 1)  # rowsum(dO * o_j): dweight's share of these rows
            ds = (w * scale) * p * (dp - r[:, None])  # gradient of the unscaled q.k products
            dq += tl.dot(ds.to(k_t.dtype), k_t, input_precision=DOT_PRECISION)
        else:
            # Pass 1: r = rowsum(dO * o_j) = sum_s P[:, s] (dO . v_s), complete before any dS.
            r = tl.zeros([ROWS], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                k_t, v_t, s_ok = _key_tile(
                    K, V, KeyMask, chunk_row0, n_keys, slot, s0, S, h, D, row_stride, HAS_KEY_MASK, BLOCK_S, BLOCK_D
                )
                p = _probabilities(q, k_t, lse, row_ok, s_ok, scale, DOT_PRECISION)
                r += tl.sum(p * tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION), 1)
            # Pass 2: this slot's output gradient is w * dO.
            for s0 in range(0, S, BLOCK_S):
                k_t, v_t, s_ok = _key_tile(
                    K, V, KeyMask, chunk_row0, n_keys, slot, s0, S, h, D, row_stride, HAS_KEY_MASK, BLOCK_S, BLOCK_D
                )
                p = _probabilities(q, k_t, lse, row_ok, s_ok, scale, DOT_PRECISION)
                dp = tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION)
                ds = (w * scale) * p * (dp - r[:, None])
                dq += tl.dot(ds.to(k_t.dtype), k_t, input_precision=DOT_PRECISION)
        tl.store(RowTerm + lse_base + rows, r, mask=row_ok)
        tl.store(dWPart + (slot * H + h) * tl.num_programs(1) + part, tl.sum(r, 0))
    store_rows(dQ, q_base, row0, end, D, row_stride, dq, ROWS, BLOCK_D)


@triton.jit
def _gca_bwd_rows_kernel(
    Q, K, V, KeyMask, Index, Weight, Lse, dO, dQ, dWPart, RowTerm, n_chunks, m_chunks, Lq, main_rows, S, H, D,
    N_SLOTS, scale,
    HAS_KEY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
):  # fmt: skip
    """The query-major backward: dQ like Q; dWPart [B, n, N_SLOTS, H, programs along axis 1]
    fp32, per-program parts of dweight; RowTerm [B, n, N_SLOTS, H, Lq] fp32, the row term
    `_gca_bwd_kv_kernel` needs. Program (bth, q_block) takes rows [q_block * BLOCK_Q, ...) of
    [0, main_rows); with TAIL > 0 one more program per (bth) takes rows [main_rows, Lq) as one
    TAIL-row tile (DRT's landmark row), so no block carries a second, mostly empty tile.

    No softmax_one flag: the saved logsumexp already includes the zero logit, so
    P = exp(scores - lse) is the right probability either way, and softmax_1 has softmax's
    Jacobian (its 1 is a constant): dS = P * (dP - rowsum(P * dP)). ONE_TILE: S <= BLOCK_S.
    """
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    bth = tl.program_id(0)
    h = bth % H
    bt = bth // H
    b = bt // n_chunks
    q_block = tl.program_id(1)
    if TAIL > 0:
        if q_block == tl.num_programs(1) - 1:  # the tail rows' own program
            _bwd_rows(
                Q, K, V, KeyMask, Index, Weight, Lse, dO, dQ, dWPart, RowTerm, bt, b, h, q_block, main_rows, Lq,
                m_chunks, Lq, S, H, D, N_SLOTS, scale, HAS_KEY_MASK, DOT_PRECISION, TAIL, BLOCK_S, BLOCK_D, ONE_TILE,
            )  # fmt: skip
            return
    _bwd_rows(
        Q, K, V, KeyMask, Index, Weight, Lse, dO, dQ, dWPart, RowTerm, bt, b, h, q_block, q_block * BLOCK_Q,
        main_rows, m_chunks, Lq, S, H, D, N_SLOTS, scale, HAS_KEY_MASK, DOT_PRECISION, BLOCK_Q, BLOCK_S,
        BLOCK_D, ONE_TILE,
    )  # fmt: skip


@triton.jit
def _kv_rows(
    Q, dO, Lse, RowTerm, k_t, v_t, s_ok, w, q_base, lse_base, row0, end, D, row_stride, scale,
    DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """(dk, dv) [BLOCK_S, BLOCK_D] of one key tile of one retrieval from its query rows [row0, end) in one tile."""
    rows = row0 + tl.arange(0, ROWS)
    row_ok = rows < end
    q = load_rows(Q, q_base, row0, end, D, row_stride, ROWS, BLOCK_D)
    do = load_rows(dO, q_base, row0, end, D, row_stride, ROWS, BLOCK_D)
    lse = tl.load(Lse + lse_base + rows, mask=row_ok, other=0.0)
    r = tl.load(RowTerm + lse_base + rows, mask=row_ok, other=0.0)
    p = _probabilities(q, k_t, lse, row_ok, s_ok, scale, DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v_t), input_precision=DOT_PRECISION)
    ds = (w * scale) * p * (dp - r[:, None])
    dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
    dv = w * tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _gca_bwd_kv_kernel(
    Q, K, V, KeyMask, Weight, Lse, RowTerm, dO, dK, dV, Slots, Offsets, m_chunks, Lq, main_rows, S, H, D, N_SLOTS,
    scale,
    HAS_KEY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, KV_ROWS: tl.constexpr,
):  # fmt: skip
    """The key-major backward: dK/dV of key tile pid2 of memory chunk pid0 (b * m + c), head
    pid1, owned by this program alone (no atomics, the same bits every run). It walks the slots
    that retrieved the chunk, Slots[Offsets[c] : Offsets[c + 1]] (global slot ids
    (b * n + t) * N_SLOTS + j), and adds each one's share from its query rows, KV_ROWS at a
    time (then the TAIL rows), with the row term r the query-major kernel stored.
    dK/dV [B, m, S, H, D] in the input dtype."""
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    bc = tl.program_id(0)
    h = tl.program_id(1)
    s0 = tl.program_id(2) * BLOCK_S
    row_stride = H * D
    base = bc.to(tl.int64) * S * row_stride + h * D
    k_t = load_rows(K, base, s0, S, D, row_stride, BLOCK_S, BLOCK_D)
    v_t = load_rows(V, base, s0, S, D, row_stride, BLOCK_S, BLOCK_D)
    tile = s0 + tl.arange(0, BLOCK_S)
    dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for e in range(tl.load(Offsets + bc), tl.load(Offsets + bc + 1)):
        slot = tl.load(Slots + e)
        w = tl.load(Weight + slot).to(tl.float32)
        s_ok = tile < S
        if HAS_KEY_MASK:
            s_ok = s_ok & (tl.load(KeyMask + slot * S + tile, mask=s_ok, other=0) != 0)
        q_base = (slot // N_SLOTS) * Lq * row_stride + h * D
        lse_base = (slot * H + h) * Lq
        for row0 in range(0, main_rows, KV_ROWS):
            dk_r, dv_r = _kv_rows(
                Q, dO, Lse, RowTerm, k_t, v_t, s_ok, w, q_base, lse_base, row0, main_rows, D, row_stride, scale,
                DOT_PRECISION, KV_ROWS, BLOCK_D,
            )  # fmt: skip
            dk += dk_r
            dv += dv_r
        if TAIL > 0:
            dk_r, dv_r = _kv_rows(
                Q, dO, Lse, RowTerm, k_t, v_t, s_ok, w, q_base, lse_base, main_rows, Lq, D, row_stride, scale,
                DOT_PRECISION, TAIL, BLOCK_D,
            )  # fmt: skip
            dk += dk_r
            dv += dv_r
    store_rows(dK, base, s0, S, D, row_stride, dk, BLOCK_S, BLOCK_D)
    store_rows(dV, base, s0, S, D, row_stride, dv, BLOCK_S, BLOCK_D)


_TILES = ["BLOCK_Q", "TAIL", "BLOCK_S", "BLOCK_D"]
# Launch settings: the fewest spills at d=64 and d=128 (`benchmarks/kernel_resources.py`).
_gca_fwd_kernel = autotuned(_gca_fwd_kernel, _TILES, default=(8, 2))
_gca_bwd_rows_kernel = autotuned(_gca_bwd_rows_kernel, _TILES, default=(8, 2))
_gca_bwd_kv_kernel = autotuned(_gca_bwd_kv_kernel, [*_TILES, "KV_ROWS"], default=(8, 2))


def kv_rows(block_q: int, block_d: int) -> int:
    """Query rows per step of the key-major kernel: it holds dk and dv of a key tile in fp32
    across its walk, so wide heads (d > 64) take 32 rows at a time to fit their registers."""
    return min(block_q, 64 if block_d <= 64 else 32)


def row_layout(lq: int, block_q: int | None) -> tuple[int, int, int]:
    """(BLOCK_Q, TAIL, main_rows): query rows [0, main_rows) in blocks of BLOCK_Q, and the rest
    (at most a quarter of a block, e.g. DRT's landmark row) as one TAIL-row tile of the last
    block (the forward) or of its own program (the backward); TAIL = 0 when the rows fit the
    blocks well."""
    block = block_q or tile_size(lq, 64)
    rest = lq % block
    if block_q is None and lq > block and 0 < rest <= block // 4:
        return block, tile_size(rest, block), lq - rest
    return block, 0, lq


class _GCATriton(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        weight: torch.Tensor,
        key_mask: torch.Tensor | None,
        softmax_one: bool,
        scale: float,
        blocks: tuple[int, int, int, int, int],
    ) -> torch.Tensor:
        batch, n, lq, heads, dim = q.shape
        m, s, n_slots = k.shape[1], k.shape[2], index.shape[2]
        block_q, tail, main_rows, block_s, block_d = blocks
        dtype = kernel_dtype(q.dtype)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, weight.dtype)
        qc, kc, vc = (x.to(dtype).contiguous() for x in (q, k, v))
        index, weight = index.contiguous(), weight.float().contiguous()
        mask = index if key_mask is None else key_mask.to(torch.uint8).contiguous()  # unused without a mask
        out = torch.zeros(qc.shape, dtype=dtype, device=q.device)
        lse = torch.zeros(batch, n, n_slots, heads, lq, dtype=torch.float32, device=q.device)
        grid = (batch * n * heads, triton.cdiv(main_rows, block_q))
        meta = dict(
            HAS_KEY_MASK=key_mask is not None,
            DOT_PRECISION=dot_precision(dtype),
            BLOCK_Q=block_q,
            TAIL=tail,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
        )
        if m > 0 and out.numel() > 0:  # with no memory every slot is empty: o = 0
            with torch.cuda.device_of(q):  # launch on q's GPU (no-op on CPU)
                _gca_fwd_kernel[grid](
                    qc, kc, vc, mask, index, weight, out, lse, n, m, lq, main_rows, s, heads, dim, n_slots, scale,
                    SOFTMAX_ONE=softmax_one, **meta,
                )  # fmt: skip
        ctx.save_for_backward(qc, kc, vc, index, weight, mask, lse)
        ctx.scale, ctx.meta, ctx.grid, ctx.main_rows = scale, meta, grid, main_rows
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, index, weight, mask, lse = ctx.saved_tensors
        batch, n, lq, heads, dim = q.shape
        m, s, n_slots = k.shape[1], k.shape[2], index.shape[2]
        meta = ctx.meta
        do = grad_out.to(q.dtype).contiguous()
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        # The query-major grid, plus one program per (chunk, head) for the tail rows.
        grid = (ctx.grid[0], ctx.grid[1] + (meta["TAIL"] > 0))
        dw_part = torch.zeros(batch, n, n_slots, heads, grid[1], dtype=torch.float32, device=q.device)
        row_term = torch.empty_like(lse)
        if m > 0 and q.numel() > 0:
            with torch.cuda.device_of(q):  # launch on q's GPU (no-op on CPU)
                _gca_bwd_rows_kernel[grid](
                    q, k, v, mask, index, weight, lse, do, dq, dw_part, row_term,
                    n, m, lq, ctx.main_rows, s, heads, dim, n_slots, ctx.scale,
                    ONE_TILE=s <= meta["BLOCK_S"], **meta,
                )  # fmt: skip
                slots, offsets = _retrievals_by_chunk(index, m)
                _gca_bwd_kv_kernel[(batch * m, heads, triton.cdiv(s, meta["BLOCK_S"]))](
                    q, k, v, mask, weight, lse, row_term, do, dk, dv, slots, offsets,
                    m, lq, ctx.main_rows, s, heads, dim, n_slots, ctx.scale,
                    KV_ROWS=kv_rows(meta["BLOCK_Q"], meta["BLOCK_D"]), **meta,
                )  # fmt: skip
        q_dtype, k_dtype, v_dtype, w_dtype = ctx.dtypes
        # Empty slots add nothing to dweight (their probabilities are 0), so theirs is exactly zero.
        dw = dw_part.sum(dim=(3, 4))
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, dw.to(w_dtype), None, None, None, None


def _retrievals_by_chunk(index: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverted index: global slot ids ((b * n + t) * K + j) sorted by the chunk (b * m + c)
    they retrieve, and offsets [B * m + 1] so that chunk c's slots are slots[offsets[c]:offsets[c + 1]]."""
    batch, n, n_slots = index.shape
    flat = index.reshape(batch, n * n_slots)
    valid = flat >= 0
    chunk = (torch.arange(batch, device=index.device)[:, None] * m + flat)[valid]
    slot = torch.arange(batch * n * n_slots, device=index.device).reshape(batch, -1)[valid]
    order = torch.argsort(chunk, stable=True)
    offsets = torch.zeros(batch * m + 1, dtype=torch.long, device=index.device)
    offsets[1:] = torch.cumsum(torch.bincount(chunk, minlength=batch * m), 0)
    return slot[order].contiguous(), offsets


def gca_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool = True,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    *,
    block_q: int | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K] -> o [B, n, Lq, H, d].

    Same semantics as `gca_reference`, key_mask [B, n, K, S] (True = real key) included;
    inputs are assumed valid (`farsight.ops.gca.gca` checks them). fp32, fp16 and bf16 inputs
    (weight in q's dtype or fp32, read as fp32); scores, softmax and accumulation are fp32, and
    fp32 dots follow torch.get_float32_matmul_precision(). Saved for the backward: the inputs
    and a logsumexp [B, n, K, H, Lq]. block_q / block_s (powers of two >= 16) override the
    query-row and key-row tile sizes (default: the next power of two of Lq / S, at most 64, with
    the rows past the last full query block, if few, as a small tile: after that block in the
    forward, a program of its own in the backward).
    """
    if q.device.type != "cuda" and not INTERPRETED:
        raise BackendUnavailableError(
            f"the Triton GCA kernels need CUDA tensors, got {q.device}; use backend='torch', or set "
            "TRITON_INTERPRET=1 before farsight.ops.gca.triton is first imported to run them on CPU"
        )
    if q.dtype == torch.float64:
        raise InputTypeError("the Triton GCA kernels support fp32, fp16 and bf16, not float64; use backend='torch'")
    check_block("block_q", block_q)
    check_block("block_s", block_s)
    lq, s, dim = q.shape[2], k.shape[2], q.shape[4]
    block_s = block_s or tile_size(s, 64)
    block_q, tail, main_rows = row_layout(lq, block_q)
    blocks = (block_q, tail, main_rows, block_s, tile_size(dim, 1 << 30))
    scale = dim**-0.5 if scale is None else float(scale)
    function = amp_function(_GCATriton, q.device.type)
    return function.apply(q, k, v, index, weight, key_mask, softmax_one, scale, blocks)
