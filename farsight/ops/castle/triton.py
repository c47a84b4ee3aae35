"""Triton kernels for CASTLE / CASTLE-SWL training and prefill (paper Algorithms 1, 3 and 4).

Notation as in `farsight.ops.castle.blockwise` (per head; a = query row, b = key, c = lookahead
token; blocks of BLOCK positions, I the query block, J the key block):

    P[b, c]   = sigmoid(scale * qu_b . ku_c) * [b < c] * [c <= b + W]
    S^U[I, J] = scale * QC_I @ D_J^(I)^T + G_I @ P[J, I]^T,   G_I = scale * tril(QC_I @ VU_I^T)
    D_J^(I)   = sum_{c < start(I)} P[J, c] vu_c              (a BLOCK x d state per key block)
    A[I, J]   = scale * QC_I @ KC_J^T - SiLU(S^U[I, J])  (b <= a),   O = row_softmax(A) @ VC

Forward (Algorithm 1, in groups of query blocks): Algorithm 1 walks the block diagonals
k = I - J so that every tile finds D_J^(I) in memory. Here G query blocks go at a time: a
lookahead launch, one program per key block J, carries D_J in registers, stores D_J^(I) for each
query block I of the group into a snapshot buffer and adds P[J, I] @ VU_I; then an attention
launch, one program per query block, keeps its row max, sum and output in registers,
flash-attention style, reading D_J^(I) from the snapshots. With a window W, P[J, I] vanishes
once I - J > ceil(W / BLOCK), so D_J is final after those "near" blocks and far tiles read it
from the final sums. The final D is the lookahead key matrix U after the whole sequence, which
is what the prefill (Algorithm 4) caches.

Backward (Algorithm 3, rescheduled): each program owns a key block J and walks the query blocks
in REVERSE order I = N-1 .. J. Going back, D_J^(I) is recovered from the saved final D by
subtracting P[J, I] @ VU_I (as in the paper; the CPU path avoids that subtraction with scans),
and R_J = sum_{I' > I} dD_J^(I') is accumulated, which is exactly the gradient of
Y_{J,I} = P[J, I] @ VU_I. Key-side gradients (dkc, dvc, dqu of J) stay in registers;
row-side ones (dqc, dvu, dku of I) are added with fp32 atomics, so their last bits vary from
run to run on GPU. `BACKWARD` picks one kernel that carries all of J's state ("fused") or two
passes over the same walk that each carry part of it ("passes"). Memory: O(T d) in both
directions (inputs, output, logsumexp, D).

Packed rows (`document_ids`; see `farsight.ops.castle` for why masking the [query, key] score
is the whole change): every kernel loads the document of each row and key of a tile and scores
pairs of different documents -inf. The document of a token is named by its first token's index
(DocStart [B, T]), and DocEnd [B, T] holds one past its last token. A tile (I, J), J <= I,
holds a pair of one document exactly when J's last key's document reaches block I, that is
when I < block_end(J) = ceil(DocEnd[last key of J] / BLOCK), or equally J >= block_start(I) =
DocStart[first row of I] // BLOCK. Every other tile is skipped: the forward's walks start at
block_start(I) and stop adding P[J, I] @ VU_I to D_J at block_end(J), and the backward starts
at block_end(J) - 1. So that skipping never changes D, the kernels also give P[b, c] = 0 for c
outside b's document (the pairs that read D are unchanged by it, as above): the final D is then
the lookahead keys summed inside each document, whatever the tile, and the backward, whose tile
may be smaller than the forward's, walks back from it exactly. A row may still find no key of
its document in a tile it visits, so the online softmax takes exp against 0 where the running
max is still -inf.

Any T (blocks are masked), any d (padded to a power of two >= 16), fp32 / fp16 / bf16 with fp32
scores, softmax and accumulation; fp16/bf16 operands are rounded to the input dtype before
each tl.dot (as flash attention does). fp32 dots follow torch.get_float32_matmul_precision().

This module needs triton; `farsight.ops.castle` imports it on first use only. For CPU tensors
set TRITON_INTERPRET=1 before importing it (the kernels are created at import).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from farsight.errors import BackendUnavailableError, InputError, InputTypeError
from farsight.ops.documents import document_positions
from farsight.ops.precision import amp_function
from farsight.ops.triton_tiles import (
    INTERPRETED,
    add_rows,
    autotuned,
    check_block,
    dot_precision,
    kernel_dtype,
    load_rows,
    store_rows,
    tile_size,
)

__all__ = ["castle_attention_triton", "castle_prefill_triton", "INTERPRETED"]


@triton.jit
def _lookahead_weights(
    qu_j,
    ku_i,
    keys,
    toks,
    doc_j,
    doc_i,
    T,
    window,
    scale,
    HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """P[J, I]: sigmoid(scale * qu_b . ku_c) where b < c (<= b + W), c < T and, with
    documents, doc(c) == doc(b); else 0."""
    z = tl.dot(qu_j, tl.trans(ku_i), input_precision=PREC) * scale
    ok = (toks[None, :] > keys[:, None]) & (toks[None, :] < T)
    if HAS_WINDOW:
        ok = ok & (toks[None, :] <= keys[:, None] + window)
    if HAS_DOCS:
        ok = ok & (doc_i[None, :] == doc_j[:, None])
    return tl.where(ok, tl.sigmoid(z), 0.0)


@triton.jit
def _diagonal_gram(qc_i, vu_i, rows, scale, PREC: tl.constexpr):
    """G_I = scale * tril(QC_I @ VU_I^T): the lookahead tokens of I that row a has seen."""
    g = tl.dot(qc_i, tl.trans(vu_i), input_precision=PREC) * scale
    return tl.where(rows[:, None] >= rows[None, :], g, 0.0)


@triton.jit
def _documents(DocStart, b, idx, T, other):
    """The document (its first token's index) of positions idx of batch row b; `other` past T."""
    return tl.load(DocStart + b.to(tl.int64) * T + idx, mask=idx < T, other=other)


@triton.jit
def _block_start(DocStart, b, i, T, BLOCK: tl.constexpr):
    """The first key block that shares a document with query block i: its first row's document's."""
    return tl.load(DocStart + b.to(tl.int64) * T + i * BLOCK) // BLOCK


@triton.jit
def _block_end(DocEnd, b, j, T, BLOCK: tl.constexpr):
    """One past the last query block that shares a document with key block j: its last key's document's end."""
    return tl.cdiv(tl.load(DocEnd + b.to(tl.int64) * T + tl.minimum(j * BLOCK + BLOCK, T) - 1), BLOCK)


@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def _fwd_tile_scores(
    qc_i,
    kc_j,
    d_j,
    g,
    p,
    rows,
    keys,
    doc_i,
    doc_j,
    T,
    scale,
    PREC: tl.constexpr,
    NEAR: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Scores A[I, J] (-inf where b > a, b >= T or, with documents, doc(b) != doc(a)); the
    G @ P^T term only for near tiles."""
    dt = qc_i.dtype
    s_u = tl.dot(qc_i, tl.trans(d_j.to(dt)), input_precision=PREC) * scale
    if NEAR:
        s_u += tl.dot(g.to(dt), tl.trans(p.to(dt)), input_precision=PREC)
    score = tl.dot(qc_i, tl.trans(kc_j), input_precision=PREC) * scale - _silu(s_u)
    ok = (keys[None, :] <= rows[:, None]) & (keys[None, :] < T)
    if HAS_DOCS:
        ok = ok & (doc_i[:, None] == doc_j[None, :])
    return tl.where(ok, score, float("-inf")), s_u


@triton.jit
def _exp_base(m, HAS_DOCS: tl.constexpr):
    """The running max to take exp against: with documents a row may have met no key of its
    document yet (max -inf), and then 0 keeps exp(-inf - max) from being NaN."""
    if HAS_DOCS:
        m = tl.where(m == float("-inf"), 0.0, m)
    return m


@triton.jit
def _castle_fwd_lookahead_kernel(
    QU,
    KU,
    VU,
    Dsum,
    Snap,
    DocStart,
    DocEnd,
    T,
    H,
    D,
    window,
    scale,
    g0,
    g1,
    j_lo,
    snap_rows,
    snap_stride,
    near,
    HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Lookahead sums for the query blocks [g0, g1) of one group: key block J = j_lo + pid0 of
    batch-head pid1 holds D_J in registers, stores D_J^(I) into Snap[I - g0] for every query
    block I of the group that J's lookahead still reaches (I - J < near), adds P[J, I] @ VU_I
    after each, and writes D_J^(g1) back to Dsum.

    Inputs [B, T, H, D]; Dsum [B, T, H, D] fp32; Snap [G, B, snap_rows, H, D] in the input
    dtype, key rows counted from block j_lo. With documents (DocStart / DocEnd [B, T] int32) P
    keeps each key's lookahead tokens to its document and J stops at block_end(J): the query
    blocks beyond hold no row of J's documents.
    """
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    j = j_lo + tl.program_id(0)
    bh = tl.program_id(1)
    row_stride = H * D
    base = (bh // H).to(tl.int64) * T * row_stride + (bh % H) * D
    keys = j * BLOCK + tl.arange(0, BLOCK)
    snap_base = (bh // H).to(tl.int64) * snap_rows * row_stride + (bh % H) * D
    qu_j = load_rows(QU, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    d_j = load_rows(Dsum, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    dt = qu_j.dtype
    i_stop = tl.minimum(g1, j + near)
    doc_j = keys  # placeholder without documents
    if HAS_DOCS:
        i_stop = tl.minimum(i_stop, _block_end(DocEnd, bh // H, j, T, BLOCK))
        doc_j = _documents(DocStart, bh // H, keys, T, -2)
    for i in range(tl.maximum(g0, j), i_stop):
        store_rows(
            Snap, snap_base + (i - g0) * snap_stride, (j - j_lo) * BLOCK, snap_rows, D, row_stride, d_j, BLOCK, BLOCK_D
        )
        rows = i * BLOCK + tl.arange(0, BLOCK)
        ku_i = load_rows(KU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        vu_i = load_rows(VU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        doc_i = rows
        if HAS_DOCS:
            doc_i = _documents(DocStart, bh // H, rows, T, -1)
        p = _lookahead_weights(qu_j, ku_i, keys, rows, doc_j, doc_i, T, window, scale, HAS_WINDOW, PREC, HAS_DOCS)
        d_j += tl.dot(p.to(dt), vu_i, input_precision=PREC)
    store_rows(Dsum, base, j * BLOCK, T, D, row_stride, d_j, BLOCK, BLOCK_D)


@triton.jit
def _merge_tile(score, vc_j, m_i, l_i, acc, PREC: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Online softmax: fold one tile of scores (and its values) into a row block's running max,
    sum and unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(score, 1))
    m_exp = _exp_base(m_new, HAS_DOCS)
    alpha = tl.exp(m_i - m_exp)
    e = tl.exp(score - m_exp[:, None])
    acc = acc * alpha[:, None] + tl.dot(e.to(vc_j.dtype), vc_j, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(e, 1), acc


@triton.jit
def _castle_fwd_attend_kernel(
    QU,
    KU,
    VU,
    QC,
    KC,
    VC,
    Dsum,
    Snap,
    Out,
    Lse,
    DocStart,
    T,
    H,
    D,
    window,
    scale,
    g0,
    j_lo,
    snap_rows,
    snap_stride,
    near,
    HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Query block I = g0 + pid0 of batch-head pid1, flash-attention style: its row max, sum
    and output stay in registers while it walks key blocks J = 0 .. I. Far blocks (I - J >=
    near, windowed only) read their final lookahead sums U_J from Dsum; near ones read D_J^(I)
    from Snap (written by the group's lookahead launch) and add the in-block term G_I P[J, I]^T.

    Out [B, T, H, D] fp32 (normalised); Lse [B, H, T] fp32. With documents (DocStart [B, T]
    int32) the walk starts at the first key block of I's first row's document.
    """
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    i = g0 + tl.program_id(0)
    bh = tl.program_id(1)
    row_stride = H * D
    base = (bh // H).to(tl.int64) * T * row_stride + (bh % H) * D
    snap_base = (bh // H).to(tl.int64) * snap_rows * row_stride + (bh % H) * D + (i - g0) * snap_stride
    rows = i * BLOCK + tl.arange(0, BLOCK)
    qc_i = load_rows(QC, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    ku_i = load_rows(KU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    vu_i = load_rows(VU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    g = _diagonal_gram(qc_i, vu_i, rows, scale, PREC).to(qc_i.dtype)  # only ever a dot operand
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    first_near = tl.maximum(i - near + 1, 0)
    j_first = 0
    doc_i = rows  # placeholder without documents
    if HAS_DOCS:
        j_first = _block_start(DocStart, bh // H, i, T, BLOCK)
        doc_i = _documents(DocStart, bh // H, rows, T, -1)
    for j in range(j_first, first_near):
        keys = j * BLOCK + tl.arange(0, BLOCK)
        kc_j = load_rows(KC, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        vc_j = load_rows(VC, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        u_j = load_rows(Dsum, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        doc_j = keys
        if HAS_DOCS:
            doc_j = _documents(DocStart, bh // H, keys, T, -2)
        score, s_u = _fwd_tile_scores(
            qc_i, kc_j, u_j, u_j, u_j, rows, keys, doc_i, doc_j, T, scale, PREC, False, HAS_DOCS
        )
        m_i, l_i, acc = _merge_tile(score, vc_j, m_i, l_i, acc, PREC, HAS_DOCS)
    for j in range(tl.maximum(first_near, j_first), i + 1):
        keys = j * BLOCK + tl.arange(0, BLOCK)
        qu_j = load_rows(QU, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        kc_j = load_rows(KC, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        vc_j = load_rows(VC, base, j * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        d_j = load_rows(Snap, snap_base, (j - j_lo) * BLOCK, snap_rows, D, row_stride, BLOCK, BLOCK_D)
        doc_j = keys
        if HAS_DOCS:
            doc_j = _documents(DocStart, bh // H, keys, T, -2)
        p = _lookahead_weights(qu_j, ku_i, keys, rows, doc_j, doc_i, T, window, scale, HAS_WINDOW, PREC, HAS_DOCS)
        score, s_u = _fwd_tile_scores(qc_i, kc_j, d_j, g, p, rows, keys, doc_i, doc_j, T, scale, PREC, True, HAS_DOCS)
        m_i, l_i, acc = _merge_tile(score, vc_j, m_i, l_i, acc, PREC, HAS_DOCS)
    # Every real row has its own key (b = a), so l > 0 there; padding rows are not stored.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    store_rows(Out, base, i * BLOCK, T, D, row_stride, acc / l_safe[:, None], BLOCK, BLOCK_D)
    tl.store(Lse + bh.to(tl.int64) * T + rows, m_i + tl.log(l_safe), mask=rows < T)


@triton.jit
def _bwd_recompute(
    KU, VU, QC, dO, Lse, Delta, DocStart, qu_j, kc_j, vc_j, d_j, i, bh, base, keys, doc_j, T, H, D,
    row_stride, window, scale,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    NEAR: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Tile (I, J) of the forward again, for the backward passes: (rows, qc_i, do_i, ku_i, vu_i,
    p, g, d_j, prob, ds, e) with d_j = D_J^(I) on return (D_J^(I+1) on entry), prob the attention
    probabilities, ds = dL/dA and e = dL/dS^U. ku_i, vu_i, p and g are placeholders on far tiles."""
    rows = i * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < T
    stat = bh.to(tl.int64) * T + rows
    qc_i = load_rows(QC, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    dt = qc_i.dtype
    doc_i = rows  # placeholder without documents
    if HAS_DOCS:
        doc_i = _documents(DocStart, bh // H, rows, T, -1)
    if NEAR:
        ku_i = load_rows(KU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        vu_i = load_rows(VU, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
        p = _lookahead_weights(qu_j, ku_i, keys, rows, doc_j, doc_i, T, window, scale, HAS_WINDOW, PREC, HAS_DOCS)
        d_j = d_j - tl.dot(p.to(dt), vu_i, input_precision=PREC)  # now D_J^(I)
        g = _diagonal_gram(qc_i, vu_i, rows, scale, PREC)
    else:
        ku_i, vu_i, p, g = qc_i, qc_i, d_j, d_j  # unused placeholders
    score, s_u = _fwd_tile_scores(qc_i, kc_j, d_j, g, p, rows, keys, doc_i, doc_j, T, scale, PREC, NEAR, HAS_DOCS)
    lse = tl.load(Lse + stat, mask=row_ok, other=0.0)
    delta = tl.load(Delta + stat, mask=row_ok, other=0.0)
    # exp(-inf - lse) = 0: pairs of different documents get no probability and no gradient
    prob = tl.where((keys[None, :] <= rows[:, None]) & row_ok[:, None], tl.exp(score - lse[:, None]), 0.0)
    do_i = load_rows(dO, base, i * BLOCK, T, D, row_stride, BLOCK, BLOCK_D)
    ds = prob * (tl.dot(do_i, tl.trans(vc_j), input_precision=PREC) - delta[:, None])  # dL/dA
    sig = tl.sigmoid(s_u)
    e = -ds * sig * (1.0 + s_u * (1.0 - sig))  # dL/dS^U = -dA * SiLU'(S^U)
    return rows, qc_i, do_i, ku_i, vu_i, p, g, d_j, prob, ds, e


@triton.jit
def _value_grads(qc_i, do_i, kc_j, d_j, prob, ds, e, dkc, dvc, scale, PREC: tl.constexpr):
    """The products through the attention scores on tile (I, J): dkc and dvc of J updated, and
    the part of dqc of I that does not go through P[J, I] (ds @ KC_J + e @ D_J^(I))."""
    dt = qc_i.dtype
    dvc += tl.dot(tl.trans(prob).to(dt), do_i, input_precision=PREC)
    dkc += scale * tl.dot(tl.trans(ds).to(dt), qc_i, input_precision=PREC)
    dqc_i = scale * tl.dot(ds.to(dt), kc_j, input_precision=PREC)
    dqc_i += scale * tl.dot(e.to(dt), d_j.to(dt), input_precision=PREC)
    return dkc, dvc, dqc_i


@triton.jit
def _lookahead_grads(
    rows, qc_i, ku_i, vu_i, qu_j, p, g, e, r_j, dqu, dqc_i, scale, PREC: tl.constexpr, NEAR: tl.constexpr
):
    """The products through the lookahead sums on tile (I, J): R_J and dqu of J updated and, on
    near tiles, the gradients through P[J, I] and G_I of I: (r_j, dqu, dqc_i, dvu_i, dku_i),
    with dqc_i's part added to the dqc_i given; dvu_i and dku_i are placeholders on far tiles."""
    dt = qc_i.dtype
    grad_y = r_j  # dL/dY_{J,I}: Y_{J,I} = P[J, I] @ VU_I enters D_J^(I') for every I' > I
    r_j = r_j + scale * tl.dot(tl.trans(e).to(dt), qc_i, input_precision=PREC)
    dvu_i, dku_i = r_j, r_j  # placeholders on far tiles
    if NEAR:
        ep = scale * tl.where(rows[:, None] >= rows[None, :], tl.dot(e.to(dt), p.to(dt), input_precision=PREC), 0.0)
        dqc_i += tl.dot(ep.to(dt), vu_i, input_precision=PREC)
        dvu_i = tl.dot(tl.trans(p).to(dt), grad_y.to(dt), input_precision=PREC)
        dvu_i += tl.dot(tl.trans(ep).to(dt), qc_i, input_precision=PREC)
        dp = tl.dot(grad_y.to(dt), tl.trans(vu_i), input_precision=PREC)
        dp += tl.dot(tl.trans(e).to(dt), g.to(dt), input_precision=PREC)
        dz = dp * p * (1.0 - p)  # p is 0 wherever masked, so the mask carries over
        dqu += scale * tl.dot(dz.to(dt), ku_i, input_precision=PREC)
        dku_i = scale * tl.dot(tl.trans(dz).to(dt), qu_j, input_precision=PREC)
    return r_j, dqu, dqc_i, dvu_i, dku_i


@triton.jit
def _bwd_tile(
    KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dkc, dvc, dqu, i,
    bh, base, keys, doc_j, T, H, D, row_stride, window, scale,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    NEAR: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Gradients of tile (I, J); returns the updated key-block state (d_j, r_j, dkc, dvc, dqu).

    On entry d_j = D_J^(I+1) and r_j = sum_{I' > I} dD_J^(I'); row-side gradients of I are
    added atomically. Far tiles (NEAR=False) have P[J, I] = 0: D_J does not change there.
    """
    rows, qc_i, do_i, ku_i, vu_i, p, g, d_j, prob, ds, e = _bwd_recompute(
        KU, VU, QC, dO, Lse, Delta, DocStart, qu_j, kc_j, vc_j, d_j, i, bh, base, keys, doc_j, T, H, D,
        row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, NEAR, HAS_DOCS,
    )  # fmt: skip
    dkc, dvc, dqc_i = _value_grads(qc_i, do_i, kc_j, d_j, prob, ds, e, dkc, dvc, scale, PREC)
    r_j, dqu, dqc_i, dvu_i, dku_i = _lookahead_grads(
        rows, qc_i, ku_i, vu_i, qu_j, p, g, e, r_j, dqu, dqc_i, scale, PREC, NEAR
    )
    if NEAR:
        add_rows(dVU, base, i * BLOCK, T, D, row_stride, dvu_i, BLOCK, BLOCK_D)
        add_rows(dKU, base, i * BLOCK, T, D, row_stride, dku_i, BLOCK, BLOCK_D)
    add_rows(dQC, base, i * BLOCK, T, D, row_stride, dqc_i, BLOCK, BLOCK_D)
    return d_j, r_j, dkc, dvc, dqu


@triton.jit
def _key_block(
    QU, KC, VC, Dsum, DocStart, DocEnd, T, H, D, n_blocks, near,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """What each backward kernel's program starts from: its key block j = pid0 of batch-head
    bh = pid1, the tiles' base offset, the keys (and their documents), QU, KC and VC of J, the
    final lookahead sums D_J, and its walk: down from query block `last` through far tiles
    (P[J, I] = 0) to `first_near`, then through the near ones down to I = j (`last` is the last
    query block that holds a row of J's documents)."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * T * H * D + (bh % H) * D
    keys = j * BLOCK + tl.arange(0, BLOCK)
    qu_j = load_rows(QU, base, j * BLOCK, T, D, H * D, BLOCK, BLOCK_D)
    kc_j = load_rows(KC, base, j * BLOCK, T, D, H * D, BLOCK, BLOCK_D)
    vc_j = load_rows(VC, base, j * BLOCK, T, D, H * D, BLOCK, BLOCK_D)
    d_j = load_rows(Dsum, base, j * BLOCK, T, D, H * D, BLOCK, BLOCK_D)
    last = n_blocks - 1
    doc_j = keys  # placeholder without documents
    if HAS_DOCS:
        last = tl.minimum(last, _block_end(DocEnd, bh // H, j, T, BLOCK) - 1)
        doc_j = _documents(DocStart, bh // H, keys, T, -2)
    return j, bh, base, keys, qu_j, kc_j, vc_j, d_j, doc_j, last, tl.minimum(last, j + near - 1)


@triton.jit
def _castle_bwd_kernel(
    QU,
    KU,
    VU,
    QC,
    KC,
    VC,
    Dsum,
    dO,
    Lse,
    Delta,
    dQU,
    dKU,
    dVU,
    dQC,
    dKC,
    dVC,
    DocStart,
    DocEnd,
    T,
    H,
    D,
    window,
    scale,
    n_blocks,
    near,
    HAS_WINDOW: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Key block pid0 of batch-head pid1 walks query blocks I = n_blocks-1 .. J (from
    block_end(J) - 1 with documents, where the forward stopped adding to D_J).

    Dsum [B, T, H, D] fp32 is the final D (= U) of the forward; Lse / Delta [B, H, T] fp32;
    dQC / dVU / dKU [B, T, H, D] fp32, zero-initialised (atomic); dQU / dKC / dVC like the
    inputs; DocStart / DocEnd [B, T] int32 (unused without documents).
    """
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    j, bh, base, keys, qu_j, kc_j, vc_j, d_j, doc_j, last, first_near = _key_block(
        QU, KC, VC, Dsum, DocStart, DocEnd, T, H, D, n_blocks, near, BLOCK, BLOCK_D, HAS_DOCS
    )
    row_stride = H * D
    r_j = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dkc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dvc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dqu = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    # Far tiles first (I >= J + near, where P[J, I] = 0), then the near ones down to I = J.
    for step in range(0, last - first_near):
        d_j, r_j, dkc, dvc, dqu = _bwd_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dkc, dvc, dqu,
            last - step, bh, base, keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D,
            False, HAS_DOCS,
        )  # fmt: skip
    for step in range(0, first_near - j + 1):
        d_j, r_j, dkc, dvc, dqu = _bwd_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dkc, dvc, dqu,
            first_near - step, bh, base, keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC, BLOCK,
            BLOCK_D, True, HAS_DOCS,
        )  # fmt: skip
    out_ty = dKC.dtype.element_ty
    store_rows(dKC, base, j * BLOCK, T, D, row_stride, dkc.to(out_ty), BLOCK, BLOCK_D)
    store_rows(dVC, base, j * BLOCK, T, D, row_stride, dvc.to(out_ty), BLOCK, BLOCK_D)
    store_rows(dQU, base, j * BLOCK, T, D, row_stride, dqu.to(out_ty), BLOCK, BLOCK_D)


@triton.jit
def _values_tile(
    KU, VU, QC, dO, Lse, Delta, dQC, DocStart, qu_j, kc_j, vc_j, d_j, dkc, dvc, i, bh, base, keys, doc_j,
    T, H, D, row_stride, window, scale,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    NEAR: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """The values pass on tile (I, J): dkc and dvc of J (returned with d_j), and the part of
    dqc of I that does not go through P[J, I] (added atomically)."""
    rows, qc_i, do_i, ku_i, vu_i, p, g, d_j, prob, ds, e = _bwd_recompute(
        KU, VU, QC, dO, Lse, Delta, DocStart, qu_j, kc_j, vc_j, d_j, i, bh, base, keys, doc_j, T, H, D,
        row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, NEAR, HAS_DOCS,
    )  # fmt: skip
    dkc, dvc, dqc_i = _value_grads(qc_i, do_i, kc_j, d_j, prob, ds, e, dkc, dvc, scale, PREC)
    add_rows(dQC, base, i * BLOCK, T, D, row_stride, dqc_i, BLOCK, BLOCK_D)
    return d_j, dkc, dvc


@triton.jit
def _lookahead_tile(
    KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dqu, i, bh, base, keys,
    doc_j, T, H, D, row_stride, window, scale,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    NEAR: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """The lookahead pass on tile (I, J): R_J (returned with d_j and dqu of J) and, on near
    tiles, the gradients through P[J, I] and G_I: dqu of J, and dku, dvu and the rest of dqc
    of I (added atomically)."""
    rows, qc_i, do_i, ku_i, vu_i, p, g, d_j, prob, ds, e = _bwd_recompute(
        KU, VU, QC, dO, Lse, Delta, DocStart, qu_j, kc_j, vc_j, d_j, i, bh, base, keys, doc_j, T, H, D,
        row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, NEAR, HAS_DOCS,
    )  # fmt: skip
    no_dqc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)  # this pass adds dqc's lookahead part alone
    r_j, dqu, dqc_i, dvu_i, dku_i = _lookahead_grads(
        rows, qc_i, ku_i, vu_i, qu_j, p, g, e, r_j, dqu, no_dqc, scale, PREC, NEAR
    )
    if NEAR:
        add_rows(dQC, base, i * BLOCK, T, D, row_stride, dqc_i, BLOCK, BLOCK_D)
        add_rows(dVU, base, i * BLOCK, T, D, row_stride, dvu_i, BLOCK, BLOCK_D)
        add_rows(dKU, base, i * BLOCK, T, D, row_stride, dku_i, BLOCK, BLOCK_D)
    return d_j, r_j, dqu


@triton.jit
def _castle_bwd_values_kernel(
    QU, KU, VU, QC, KC, VC, Dsum, dO, Lse, Delta, dQC, dKC, dVC, DocStart, DocEnd,
    T, H, D, window, scale, n_blocks, near,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Backward in passes, the values pass: key block pid0 of batch-head pid1 walks the query
    blocks down from the last, carrying D_J, dkc and dvc (three fp32 tiles where the fused
    kernel carries five), writes dKC and dVC of J and adds the part of dQC that does not go
    through the lookahead weights (ds @ KC_J + e @ D_J^(I)) atomically. Arguments as
    `_castle_bwd_kernel`'s."""
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    j, bh, base, keys, qu_j, kc_j, vc_j, d_j, doc_j, last, first_near = _key_block(
        QU, KC, VC, Dsum, DocStart, DocEnd, T, H, D, n_blocks, near, BLOCK, BLOCK_D, HAS_DOCS
    )
    row_stride = H * D
    dkc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dvc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    for step in range(0, last - first_near):
        d_j, dkc, dvc = _values_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, DocStart, qu_j, kc_j, vc_j, d_j, dkc, dvc, last - step, bh, base,
            keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, False, HAS_DOCS,
        )  # fmt: skip
    for step in range(0, first_near - j + 1):
        d_j, dkc, dvc = _values_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, DocStart, qu_j, kc_j, vc_j, d_j, dkc, dvc, first_near - step, bh,
            base, keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, True,
            HAS_DOCS,
        )  # fmt: skip
    out_ty = dKC.dtype.element_ty
    store_rows(dKC, base, j * BLOCK, T, D, row_stride, dkc.to(out_ty), BLOCK, BLOCK_D)
    store_rows(dVC, base, j * BLOCK, T, D, row_stride, dvc.to(out_ty), BLOCK, BLOCK_D)


@triton.jit
def _castle_bwd_lookahead_kernel(
    QU, KU, VU, QC, KC, VC, Dsum, dO, Lse, Delta, dQU, dKU, dVU, dQC, DocStart, DocEnd,
    T, H, D, window, scale, n_blocks, near,
    HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Backward in passes, the lookahead pass: the same walk carrying D_J, R_J and dqu; writes
    dQU of J and adds dKU, dVU and the rest of dQC (the gradients through P[J, I] and G_I,
    near tiles only) atomically. Far tiles only recompute e to extend R_J."""
    scale = tl.cast(scale, tl.float32)  # torch.compile passes a Python float as fp64
    j, bh, base, keys, qu_j, kc_j, vc_j, d_j, doc_j, last, first_near = _key_block(
        QU, KC, VC, Dsum, DocStart, DocEnd, T, H, D, n_blocks, near, BLOCK, BLOCK_D, HAS_DOCS
    )
    row_stride = H * D
    r_j = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dqu = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    for step in range(0, last - first_near):
        d_j, r_j, dqu = _lookahead_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dqu, last - step,
            bh, base, keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC, BLOCK, BLOCK_D, False,
            HAS_DOCS,
        )  # fmt: skip
    for step in range(0, first_near - j + 1):
        d_j, r_j, dqu = _lookahead_tile(
            KU, VU, QC, dO, Lse, Delta, dQC, dVU, dKU, DocStart, qu_j, kc_j, vc_j, d_j, r_j, dqu,
            first_near - step, bh, base, keys, doc_j, T, H, D, row_stride, window, scale, HAS_WINDOW, PREC,
            BLOCK, BLOCK_D, True, HAS_DOCS,
        )  # fmt: skip
    store_rows(dQU, base, j * BLOCK, T, D, row_stride, dqu.to(dQU.dtype.element_ty), BLOCK, BLOCK_D)


def _near_diagonals(n_blocks: int, block: int, window: int | None) -> int:
    """Block diagonals k = I - J on which P[J, I] can be non-zero: c - b >= (k - 1) * block + 1."""
    if window is None:
        return n_blocks
    return min(n_blocks, -(-window // block) + 1)


_TILES = ["BLOCK", "BLOCK_D", "HAS_WINDOW", "HAS_DOCS"]
_castle_fwd_lookahead_kernel = autotuned(_castle_fwd_lookahead_kernel, _TILES, default=(8, 2), restore_value=["Dsum"])
# The attention launch per head-dim range: 64-row tiles of d <= 64 spill least with 4 warps and
# one stage, 32-row tiles of d = 128 not at all with 8 (`benchmarks/kernel_resources.py`).
_ATTEND_KERNELS = {
    True: autotuned(_castle_fwd_attend_kernel, _TILES, default=(4, 1)),
    False: autotuned(_castle_fwd_attend_kernel, _TILES, default=(8, 1)),
}
_castle_bwd_kernel = autotuned(_castle_bwd_kernel, _TILES, default=(8, 1), reset_to_zero=["dQC", "dVU", "dKU"])
_castle_bwd_values_kernel = autotuned(_castle_bwd_values_kernel, _TILES, default=(8, 1), reset_to_zero=["dQC"])
# The lookahead pass adds to the dQC of the values pass: autotuning restores it between trials.
_castle_bwd_lookahead_kernel = autotuned(
    _castle_bwd_lookahead_kernel, _TILES, default=(8, 1), reset_to_zero=["dVU", "dKU"], restore_value=["dQC"]
)

# The backward's layout: "fused" (one key-major kernel carries D, R and three gradients per key
# block: five fp32 tiles) or "passes" (a values pass carrying D, dkc and dvc, then a lookahead
# pass carrying D, R and dqu: three tiles each, for about 1.4x the fused kernel's products).
# FARSIGHT_CASTLE_BACKWARD in the environment sets it for a whole process (e.g. `farsight train`).
BACKWARD = os.environ.get("FARSIGHT_CASTLE_BACKWARD") or "fused"
BACKWARDS = ("fused", "passes")


# Memory the grouped forward may spend on its snapshots of the lookahead sums.
SNAPSHOT_BYTES = 1 << 30


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids [B, T] -> (DocStart, DocEnd) [B, T] int32 contiguous: the index of the first
    token of each token's document (which names the document) and one past its last."""
    ids = document_ids.long().contiguous()
    start = torch.arange(ids.shape[1], device=ids.device) - document_positions(ids)
    end = torch.searchsorted(ids, ids, right=True)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _document_args(docs: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor) -> dict[str, Any]:
    """The kernels' document arguments; without documents any tensor stands in for the unused pointers."""
    start, end = docs if docs is not None else (like, like)
    return dict(DocStart=start, DocEnd=end, HAS_DOCS=docs is not None)


def group_size(batch: int, heads: int, n_blocks: int, snapshot_block_bytes: int, device: torch.device) -> int:
    """Query blocks per group of the grouped forward: enough attention programs (group x B x H)
    to fill the GPU twice over, within SNAPSHOT_BYTES of snapshots (snapshot_block_bytes each)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = -(-2 * sms // (batch * heads))
    return max(1, min(n_blocks, wanted, SNAPSHOT_BYTES // max(1, snapshot_block_bytes)))


def _forward(
    inputs: list[torch.Tensor],
    window: int | None,
    scale: float,
    block: int,
    block_d: int,
    group: int | None,
    docs: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Query blocks in groups of G. Per group, one launch computes every lookahead sum D_J^(I)
    the group's tiles need (key-block programs carry D_J on chip and store snapshots), then one
    launch attends (query-block programs keep their softmax state on chip). 2 T / (G BLOCK)
    launches, no atomics; the snapshots take G x B x min(T, (G + near) BLOCK) x H x d elements."""
    qu, ku, vu, qc, kc, vc = inputs
    batch, steps, heads, dim = qu.shape
    dsum = torch.zeros(qu.shape, dtype=torch.float32, device=qu.device)
    out = torch.empty_like(dsum)
    lse = torch.empty((batch, heads, steps), dtype=torch.float32, device=qu.device)
    n_blocks = triton.cdiv(steps, block)
    near = _near_diagonals(n_blocks, block, window)
    if group is None:
        per_block = batch * min(n_blocks, near + 16) * block * heads * dim * qu.element_size()
        group = group_size(batch, heads, n_blocks, per_block, qu.device)
    group = min(group, n_blocks)
    snap_rows = min(n_blocks, group + near - 1) * block
    snap = torch.empty((group, batch, snap_rows, heads, dim), dtype=qu.dtype, device=qu.device)
    snap_stride = snap[0].numel()
    meta = dict(HAS_WINDOW=window is not None, PREC=dot_precision(qu.dtype), BLOCK=block, BLOCK_D=block_d)
    doc_args = _document_args(docs, dsum)
    doc_start = dict(DocStart=doc_args["DocStart"], HAS_DOCS=doc_args["HAS_DOCS"])
    with torch.cuda.device_of(qu):  # launch on the inputs' GPU (no-op on CPU)
        for g0 in range(0, n_blocks, group):
            g1 = min(n_blocks, g0 + group)
            j_lo = max(0, g0 - near + 1)  # key blocks before it have their final sums in dsum
            _castle_fwd_lookahead_kernel[(g1 - j_lo, batch * heads)](
                qu, ku, vu, dsum, snap, T=steps, H=heads, D=dim, window=window or 0, scale=scale,
                g0=g0, g1=g1, j_lo=j_lo, snap_rows=snap_rows, snap_stride=snap_stride, near=near,
                **doc_args, **meta,
            )  # fmt: skip
            _ATTEND_KERNELS[block_d <= 64][(g1 - g0, batch * heads)](
                qu, ku, vu, qc, kc, vc, dsum, snap, out, lse, T=steps, H=heads, D=dim, window=window or 0,
                scale=scale, g0=g0, j_lo=j_lo, snap_rows=snap_rows, snap_stride=snap_stride, near=near,
                **doc_start, **meta,
            )  # fmt: skip
    return out, lse, dsum


def _prepare(tensors: tuple[torch.Tensor, ...], block: int | None) -> tuple[list[torch.Tensor], int, int]:
    qu = tensors[0]
    if qu.device.type != "cuda" and not INTERPRETED:
        raise BackendUnavailableError(
            f"the Triton CASTLE kernels need CUDA tensors, got {qu.device}; use backend='torch', or set "
            "TRITON_INTERPRET=1 before farsight.ops.castle.triton is first imported to run them on CPU"
        )
    if qu.dtype == torch.float64:
        raise InputTypeError("the Triton CASTLE kernels support fp32, fp16 and bf16, not float64; use backend='torch'")
    check_block("block", block)
    dim = qu.shape[-1]
    block_d = tile_size(dim, 1 << 30)
    block = block or tile_size(qu.shape[1], forward_block(block_d))
    dtype = kernel_dtype(qu.dtype)
    return [x.to(dtype).contiguous() for x in tensors], block, block_d


def forward_block(block_d: int) -> int:
    """The forward's tile for long rows: each program holds several BLOCK x d fp32 tiles, so
    wide heads (d > 64) take 32 rows."""
    return 64 if block_d <= 64 else 32


def backward_block(block: int, block_d: int) -> int:
    """The backward's tile. The fused kernel keeps five fp32 key-block tiles (D, R and three
    gradients) and a score tile's worth of temporaries per program, each pass three; both spill
    registers at 64 rows, and the passes fit at 32 rows for d <= 64 and 16 for d = 128
    (`benchmarks/kernel_resources.py`). The lookahead sums and logsumexp it reads are per row,
    so any tile works."""
    return min(block, 32 if block_d <= 64 else 16)


class _CastleTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, qu, ku, vu, qc, kc, vc, window, scale, block, group, bwd_block, document_ids):  # type: ignore[override]
        check_block("backward_block", bwd_block)
        inputs, block, block_d = _prepare((qu, ku, vu, qc, kc, vc), block)
        ctx.backward_block = bwd_block
        docs = None if document_ids is None or qu.numel() == 0 else document_bounds(document_ids)
        if qu.numel() == 0:
            out = torch.zeros(qu.shape, dtype=torch.float32, device=qu.device)
            lse = dsum = out
        else:
            out, lse, dsum = _forward(inputs, window, scale, block, block_d, group, docs)
        out = out.to(inputs[0].dtype)
        ctx.save_for_backward(*inputs, out, lse, dsum, *(docs or ()))
        ctx.config = (window, scale, block, block_d)
        ctx.dtype = qu.dtype
        return out.to(qu.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        if BACKWARD not in BACKWARDS:
            raise InputError(
                f"the CASTLE backward layout (FARSIGHT_CASTLE_BACKWARD) must be one of {BACKWARDS}, got {BACKWARD!r}"
            )
        *inputs, out, lse, dsum = ctx.saved_tensors[:9]
        docs = tuple(ctx.saved_tensors[9:]) or None
        window, scale, block, block_d = ctx.config
        block = ctx.backward_block or backward_block(block, block_d)
        qu = inputs[0]
        batch, steps, heads, dim = qu.shape
        do = grad_out.to(qu.dtype).contiguous()
        # Atomically accumulated (row side) in fp32; the key side is written once per block.
        dqc, dvu, dku = (torch.zeros(qu.shape, dtype=torch.float32, device=qu.device) for _ in range(3))
        dqu, dkc, dvc = (torch.zeros_like(qu) for _ in range(3))
        if qu.numel():
            delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, T]
            n_blocks = triton.cdiv(steps, block)
            grid = (n_blocks, batch * heads)
            meta = dict(
                T=steps,
                H=heads,
                D=dim,
                window=window or 0,
                scale=scale,
                n_blocks=n_blocks,
                near=_near_diagonals(n_blocks, block, window),
                HAS_WINDOW=window is not None,
                PREC=dot_precision(qu.dtype),
                BLOCK=block,
                BLOCK_D=block_d,
                **_document_args(docs, dsum),
            )
            with torch.cuda.device_of(qu):
                if BACKWARD == "passes":
                    _castle_bwd_values_kernel[grid](*inputs, dsum, do, lse, delta, dQC=dqc, dKC=dkc, dVC=dvc, **meta)
                    _castle_bwd_lookahead_kernel[grid](
                        *inputs, dsum, do, lse, delta, dQU=dqu, dKU=dku, dVU=dvu, dQC=dqc, **meta
                    )
                else:
                    _castle_bwd_kernel[grid](*inputs, dsum, do, lse, delta, dqu, dku, dvu, dqc, dkc, dvc, **meta)
        grads = [
            g.to(ctx.dtype) if needed else None
            for g, needed in zip((dqu, dku, dvu, dqc, dkc, dvc), ctx.needs_input_grad[:6])
        ]
        return (*grads, None, None, None, None, None, None)


def castle_attention_triton(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    *,
    block: int | None = None,
    group: int | None = None,
    backward_block: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Six [B, T, H, d] inputs -> o [B, T, H, d]; same semantics as `castle_parallel_reference`.

    Inputs are assumed valid (`farsight.ops.castle.castle_attention` checks them). fp32, fp16
    and bf16; saved for the backward: the inputs, the output, a logsumexp [B, H, T] and the
    final lookahead sums U [B, T, H, d] (fp32). `block` (a power of two >= 16) is the query and
    key tile (default: next power of two of T, at most 64, or 32 when d > 64); `group` is the
    number of query blocks per launch pair of the forward (default: `group_size`);
    `backward_block` is the backward's tile (default: `backward_block(block, d)`).
    `document_ids` [B, T] (assumed valid; None for one document per row): packed rows, see the
    module docstring.
    """
    scale = qu.shape[-1] ** -0.5 if scale is None else float(scale)
    function = amp_function(_CastleTriton, qu.device.type)
    return function.apply(qu, ku, vu, qc, kc, vc, window, scale, block, group, backward_block, document_ids)


def castle_prefill_triton(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    *,
    block: int | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 4 without autograd: (o [B, T, H, d] in the input dtype, U [B, H, T, d] fp32).

    U (the lookahead keys after all T tokens) is the final D of the same forward launches.
    Inputs are assumed valid (`farsight.ops.castle.castle_prefill` checks them).
    """
    scale = qu.shape[-1] ** -0.5 if scale is None else float(scale)
    inputs, block, block_d = _prepare((qu, ku, vu, qc, kc, vc), block)
    with torch.no_grad():
        if qu.numel() == 0:
            return qu.new_empty(qu.shape), torch.zeros(qu.transpose(1, 2).shape, dtype=torch.float32, device=qu.device)
        out, _, dsum = _forward(inputs, window, scale, block, block_d, group)
    return out.to(qu.dtype), dsum.transpose(1, 2).contiguous()
