"""CASTLE training path on any device: O(T^2 d) time, O(T d) memory in forward and backward.

Notation (per head; 0-based positions; a = query row, b = key, c = lookahead token):

    P[b, c]   = sigmoid(scale * qu_b . ku_c) * [b < c] * [c <= b + W]
    S^U[a, b] = scale * sum_{c <= a} P[b, c] (qc_a . vu_c)
    A[a, b]   = scale * qc_a . kc_b - SiLU(S^U[a, b])  for b <= a,   O = row_softmax(A) VC

The sequence is zero-padded to a multiple of the key block (padded positions come after every
real one, so causality keeps them out of real rows; they are sliced off). The loop runs over
KEY blocks J (`block` keys) and handles all later query rows at once. For a query row
sub-block I (`sub` rows, at or after the start of J), S^U[I, J] splits by where c lies:

    c in a sub-block before I:  scale * QC_I @ D_J^(I)^T,   D_J^(I) = sum_{c < start(I)} P[J, c] vu_c
    c inside sub-block I:       G_I @ P[J, I]^T,            G_I = scale * tril(QC_I VU_I^T)

With Y_I = P[J, I] @ VU_I, all D_J^(I) are one exclusive prefix sum of Y over I, so a key
block costs a handful of batched matmuls and O(T d) memory. The sums only add (no running sum
is ever subtracted), which keeps fp32 accurate at long T. The diagonal term costs
O(T^2 * sub) and the prefix sums O(T^2 d / sub) in all, which is why the row sub-block is
separate from (and smaller than) the key block.

With a window W, P[J, c] vanishes for c > end(J) + W, so D_J stops changing after a few
sub-blocks: the P / Y work is restricted to those "near" sub-blocks and the final D_J (the
inclusive total) serves every row beyond; this is where CASTLE-SWL saves work. That total is
also the lookahead key U[J] after the whole sequence, which the UQ-KV cache of the prefill
needs (`forward_with_lookahead_keys`; the cache itself is in `farsight.ops.castle.inference`).

Packed rows (`document_ids` [B, T]; see `farsight.ops.castle` for why this is all): the score
column block of key block J is -inf where query and key lie in different documents, and the
running max starts at the lowest finite value instead of -inf (a block may hold no key of a
row's document, and exp(-inf - (-inf)) is NaN). Because documents are contiguous, no row at or
past stop(J) (the end of the document of J's last key, the latest over the batch, rounded up to
a row sub-block) shares a document with J, so the work of key block J (its rows, and its
lookahead tokens c, which only matter to rows a >= c) stops there. Those rows would only have
added exact zeros, so the skip is exact; it leaves D_J short of U, which is why the prefill,
which caches U, takes no documents.

`scale` is folded into the packed qu and qc once, so the sigmoid logits, scores and S^U come
out of their matmuls already scaled. The backward recomputes every block; autograd keeps only
the inputs, the output and the per-row logsumexp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from farsight.ops.checks import compute_dtype
from farsight.ops.documents import same_document
from farsight.ops.library import custom_op
from farsight.ops.precision import software_matmul_dtypes

# Tuned on a 2-core AVX-512 CPU (benchmarks/castle.py): fewer, larger key blocks cut Python
# overhead; a 64-row sub-block balances the diagonal term against the prefix sums.
DEFAULT_BLOCK_SIZE = 128
ROW_SUB_BLOCK = 64
# Up to this many sub-blocks a prefix sum is one matmul with a triangular 0/1 matrix (at 30 it
# took 0.25 ms where groups of 16 and their padding took 0.72, [4, 30, 8192] fp32, AMX Xeon).
_SCAN_GROUP = 64


@dataclass(frozen=True)
class _Plan:
    """Block geometry of one call: `steps` real positions padded to `n_blocks * block`.

    Key blocks have `block` positions; the S^U split into "before" and "inside" works on row
    sub-blocks of `sub` positions (`block` is a multiple of `sub`).
    """

    steps: int
    block: int
    sub: int
    window: int | None
    scale: float

    @classmethod
    def make(cls, steps: int, block_size: int, window: int | None, scale: float) -> _Plan:
        sub = min(block_size, ROW_SUB_BLOCK)
        if block_size % sub:
            sub = block_size
        block = min(block_size, -(-max(steps, 1) // sub) * sub)
        return cls(steps, block, sub, window, scale)

    @property
    def n_blocks(self) -> int:
        return -(-self.steps // self.block)

    @property
    def padded(self) -> int:
        return self.n_blocks * self.block

    @property
    def n_subs(self) -> int:
        return self.padded // self.sub

    def near_subs(self, j: int, stop: int | None = None) -> int:
        """Row sub-blocks from start(J) on that can hold a lookahead token c <= b + W of block j
        (and lie before row `stop`, a multiple of `sub`, when given)."""
        last = self.padded if stop is None else stop
        if self.window is not None:
            last = min(last, (j + 1) * self.block + self.window)  # one past the last such c
        return -(-(last - j * self.block) // self.sub)


class _Documents(NamedTuple):
    """Document ids of a packed batch, padded like the inputs, and where each key block's rows end."""

    ids: torch.Tensor  # [B, T_padded] long; the padding continues the last document
    heads: int
    stops: list[int]  # per key block j: one past the last row (a multiple of sub) of a document of j

    @classmethod
    def make(cls, document_ids: torch.Tensor | None, plan: _Plan, heads: int) -> _Documents | None:
        if document_ids is None:
            return None
        ids = document_ids.to(torch.long)
        ids = torch.cat([ids, ids[:, -1:].expand(-1, plan.padded - plan.steps)], dim=1).contiguous()
        # ends[b, t]: one past the last token of t's document; the last key of each block has the
        # latest document of the block, so its end bounds the rows that share one with the block.
        ends = torch.searchsorted(ids, ids, right=True)[:, plan.block - 1 :: plan.block].amax(dim=0)
        stops = (-(-ends // plan.sub) * plan.sub).clamp_(max=plan.padded).tolist()
        return cls(ids, heads, stops)

    def mask_scores(self, score: torch.Tensor, r0: int, r1: int) -> None:
        """-inf into score [N, rows, keys] for the rows r0.. and keys r0..r1 of different documents."""
        rows = r0 + score.shape[1]
        other = ~same_document(self.ids[:, r0:rows], self.ids[:, r0:r1])
        score.view(-1, self.heads, *score.shape[1:]).masked_fill_(other[:, None], float("-inf"))


def _stop(plan: _Plan, docs: _Documents | None, j: int) -> int:
    """One past the last row that key block j can matter to."""
    return plan.padded if docs is None else docs.stops[j]


class _Masks(NamedTuple):
    lookahead: torch.Tensor  # [block, near_subs(0) * sub], 1.0 where 0 < c - b <= W
    above_diagonal: torch.Tensor  # bool [block, block], True where key b > query a
    tril: torch.Tensor  # [sub, sub], 1.0 where a >= c
    scan_lower: torch.Tensor  # [_SCAN_GROUP, _SCAN_GROUP] strictly lower triangular ones
    scan_upper: torch.Tensor  # its transpose


def lookahead_mask(rows: int, cols: int, window: int | None, device: torch.device, col_offset: int = 0) -> torch.Tensor:
    """Bool [rows, cols]: True where key b = row may take lookahead token c = col_offset + col.

    Holds for b < c (and c <= b + window with a window); the `c <= t` bound of the recurrent
    form is the caller's business (it is causality of the query, not of the key). The
    references in farsight.ops.castle.reference write their own mask, so that they judge this one.
    """
    b = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :] + col_offset
    mask = c > b
    if window is not None:
        mask &= c <= b + window
    return mask


def _masks(plan: _Plan, dtype: torch.dtype, device: torch.device) -> _Masks:
    # Relative to the start of key block J, the lookahead condition only depends on c - b,
    # so one mask serves every key block. The 0/1 masks of the products are in the operands'
    # dtype (exact), the scan's in the compute dtype (the prefix sums are accumulators).
    work = compute_dtype(dtype)
    lookahead = lookahead_mask(plan.block, plan.near_subs(0) * plan.sub, plan.window, device).to(dtype)
    above = torch.ones(plan.block, plan.block, dtype=torch.bool, device=device).triu(1)
    tril = torch.ones(plan.sub, plan.sub, dtype=dtype, device=device).tril()
    lower = torch.ones(_SCAN_GROUP, _SCAN_GROUP, dtype=work, device=device).tril(-1)
    return _Masks(lookahead, above, tril, lower, lower.t().contiguous())


def operand_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the matrix products of inputs in `dtype` take: fp16/bf16 themselves where the
    device multiplies them in hardware, else the compute dtype (fp32; fp64 for fp64)."""
    if dtype in (torch.float16, torch.bfloat16) and dtype not in software_matmul_dtypes(device):
        return dtype
    return compute_dtype(dtype)


def _pack(x: torch.Tensor, plan: _Plan, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, d] -> zero-padded [B * H, T_padded, d] in `dtype`."""
    batch, steps, heads, dim = x.shape
    out = x.new_empty(batch, heads, plan.padded, dim, dtype=dtype)
    out[:, :, :steps] = x.transpose(1, 2)
    out[:, :, steps:] = 0
    return out.view(batch * heads, plan.padded, dim)


def _pack_all(inputs: tuple[torch.Tensor, ...], plan: _Plan, dtype: torch.dtype) -> list[torch.Tensor]:
    """Pack (qu, ku, vu, qc, kc, vc) and fold `scale` into qu and qc: every product that
    needs it (sigmoid logits, scores, S^U) then comes out of a matmul already scaled."""
    packed = [_pack(x, plan, dtype) for x in inputs]
    packed[0].mul_(plan.scale)
    packed[3].mul_(plan.scale)
    return packed


def _unpack(x: torch.Tensor, plan: _Plan, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """[B * H, T_padded, d] -> [B, T, H, d] in `dtype` (drops the padding)."""
    batch, steps, heads, dim = shape
    return x.view(batch, heads, plan.padded, dim)[:, :, :steps].transpose(1, 2).to(dtype).contiguous()


def _subs(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[N, T_padded, k] -> [N, n_subs, sub, k] (a view)."""
    return x.view(x.shape[0], plan.n_subs, plan.sub, x.shape[-1])


def _diagonal_gram(qc: torch.Tensor, vu: torch.Tensor, plan: _Plan, masks: _Masks) -> torch.Tensor:
    """G_I = tril(QC_I VU_I^T) for every row sub-block (qc pre-scaled): [N, n_subs, sub, sub].

    It does not depend on the key block, so it is formed once per call.
    """
    return (_subs(qc, plan) @ _subs(vu, plan).transpose(-1, -2)).mul_(masks.tril)


def _exclusive_scan(y: torch.Tensor, masks: _Masks, reverse: bool = False) -> torch.Tensor:
    """Exclusive prefix sum over dim 1 of y [N, n, M] (suffix sum if `reverse`): [N, n, M].

    torch.cumsum over a non-innermost dim runs a scalar strided loop that costs more than all
    the block matmuls around it, so the scan is a matmul with a strictly triangular 0/1 matrix
    inside groups of _SCAN_GROUP rows plus a recursive scan of the group totals: only additions
    (no running sum is subtracted) and O(n * _SCAN_GROUP * M) work.
    """
    n_rows, n, width = y.shape
    if n <= _SCAN_GROUP:
        return torch.matmul((masks.scan_upper if reverse else masks.scan_lower)[:n, :n], y)
    n_groups = -(-n // _SCAN_GROUP)
    if n % _SCAN_GROUP:
        y = F.pad(y, (0, 0, 0, n_groups * _SCAN_GROUP - n))
    grouped = y.view(n_rows, n_groups, _SCAN_GROUP, width)
    out = torch.matmul(masks.scan_upper if reverse else masks.scan_lower, grouped)
    out += _exclusive_scan(grouped.sum(dim=2), masks, reverse).unsqueeze(2)
    return out.view(n_rows, n_groups * _SCAN_GROUP, width)[:, :n]


class _KeyBlock(NamedTuple):
    """Everything about key block j that both passes need (all O(T * block) or O(T d)).
    p and s_u are in the operands' dtype, the sums D in the compute dtype and, as operands of
    the products that read them, rounded to the operands' (d_excl_op, d_total_op)."""

    near: int  # row sub-blocks from start(J) that can hold lookahead tokens of block j
    p: torch.Tensor  # [N, near, block_b, sub_c] lookahead weights P[J, I]
    d_excl: torch.Tensor  # [N, near, block_b, d] D_J^(I) for the near row sub-blocks
    d_total: torch.Tensor  # [N, block_b, d] sum over all c: D_J for rows beyond, and U[J]
    s_u: torch.Tensor  # [N, rows from start(J), block_b] S^U column block
    d_excl_op: torch.Tensor
    d_total_op: torch.Tensor


def _key_block(
    j: int,
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    gram: torch.Tensor,
    plan: _Plan,
    masks: _Masks,
    stop: int,
) -> _KeyBlock:
    """Lookahead weights, D and S^U of key block j for the rows before `stop` (qu and qc pre-scaled)."""
    n, _, dim = qu.shape
    op, work = qu.dtype, compute_dtype(qu.dtype)
    bk, sub = plan.block, plan.sub
    near, s0 = plan.near_subs(j, stop), j * bk // sub
    c0, c1 = j * bk, j * bk + near * sub
    p_flat = torch.bmm(qu[:, c0 : c0 + bk], ku[:, c0:c1].transpose(1, 2)).sigmoid_()  # [N, block_b, near*sub]
    if plan.window is None:
        # Without a window only c inside the key block itself can fail c > b.
        p_flat[:, :, :bk].mul_(masks.lookahead[:, :bk])
    else:
        p_flat.mul_(masks.lookahead[:, : c1 - c0])
    p = p_flat.view(n, bk, near, sub).transpose(1, 2).contiguous()
    y = torch.matmul(p, _subs(vu, plan)[:, s0 : s0 + near]).to(work)  # [N, near, block_b, d]
    d_excl = _exclusive_scan(y.view(n, near, bk * dim), masks).view(n, near, bk, dim)
    d_total = d_excl[:, -1] + y[:, -1]
    d_excl_op, d_total_op = d_excl.to(op), d_total.to(op)
    s_near = torch.matmul(gram[:, s0 : s0 + near], p.transpose(-1, -2))  # [N, near, sub_a, block_b]
    s_near += torch.matmul(_subs(qc, plan)[:, s0 : s0 + near], d_excl_op.transpose(-1, -2))
    s_near = s_near.view(n, near * sub, bk)
    if c1 < stop:
        s_u = torch.cat([s_near, torch.bmm(qc[:, c1:stop], d_total_op.transpose(1, 2))], dim=1)
    else:
        s_u = s_near
    return _KeyBlock(near, p, d_excl, d_total, s_u, d_excl_op, d_total_op)


def _scores(
    j: int,
    kb: _KeyBlock,
    qc: torch.Tensor,
    kc: torch.Tensor,
    plan: _Plan,
    masks: _Masks,
    docs: _Documents | None,
    stop: int,
) -> torch.Tensor:
    """Score column block A[start(J) <= rows < stop, J] in the compute dtype: [N, rows, block],
    -inf above the diagonal and between documents."""
    bk = plan.block
    score = torch.bmm(qc[:, j * bk : stop], kc[:, j * bk : (j + 1) * bk].transpose(1, 2)).to(compute_dtype(qc.dtype))
    score -= F.silu(kb.s_u)
    score[:, :bk].masked_fill_(masks.above_diagonal, float("-inf"))
    if docs is not None:
        docs.mask_scores(score, j * bk, (j + 1) * bk)
    return score


def _forward(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    plan: _Plan,
    want_lookahead: bool = False,
    docs: _Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Packed inputs [N, T_padded, d] (the operands' dtype), qu and qc pre-scaled -> (o, lse
    [N, T_padded], U or None), all in the compute dtype.

    Online softmax over key blocks (column-outer): running max, sum and output for all rows.
    U [N, T_padded, d] (the lookahead keys after the whole sequence) when `want_lookahead`
    (without documents). With documents a block may hold no key of a row's document, so the
    running max starts at the dtype's lowest finite value: such a block then rescales by
    exp(0) = 1 and adds exp(-inf) = 0 where -inf - (-inf) would give NaN.
    """
    n, tp, dim = qu.shape
    op, work = qu.dtype, compute_dtype(qu.dtype)
    bk = plan.block
    masks = _masks(plan, op, qu.device)
    gram = _diagonal_gram(qc, vu, plan, masks)
    row_max = qu.new_full((n, tp), float("-inf") if docs is None else torch.finfo(work).min, dtype=work)
    row_sum = qu.new_zeros(n, tp, dtype=work)
    acc = qu.new_zeros(n, tp, dim, dtype=work)
    lookahead = qu.new_empty(n, tp, dim, dtype=work) if want_lookahead else None
    for j in range(plan.n_blocks):
        r0, r1, stop = j * bk, (j + 1) * bk, _stop(plan, docs, j)
        kb = _key_block(j, qu, ku, vu, qc, gram, plan, masks, stop)
        if lookahead is not None:
            lookahead[:, r0:r1] = kb.d_total
        score = _scores(j, kb, qc, kc, plan, masks, docs, stop)
        m_old = row_max[:, r0:stop]
        m_new = torch.maximum(m_old, score.amax(dim=-1))
        rescale = (m_old - m_new).exp_()
        weights = score.sub_(m_new.unsqueeze(-1)).exp_()
        row_sum[:, r0:stop].mul_(rescale).add_(weights.sum(dim=-1))
        if op == work:
            acc[:, r0:stop].mul_(rescale.unsqueeze(-1)).baddbmm_(weights, vc[:, r0:r1])
        else:
            acc[:, r0:stop].mul_(rescale.unsqueeze(-1)).add_(torch.bmm(weights.to(op), vc[:, r0:r1]))
        m_old.copy_(m_new)
    out = acc.div_(row_sum.unsqueeze(-1))
    lse = row_max.add_(row_sum.log_())
    return out, lse, lookahead


def _backward(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    plan: _Plan,
    docs: _Documents | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients (compute dtype) w.r.t. the six packed inputs as `_forward` saw them (qu, qc
    pre-scaled); out and grad_out packed like them.

    Every block is recomputed. The S^U branch carries the NEGATED gradient
    (-dS^U = dA * SiLU'(S^U), one fused silu_backward), so its accumulations subtract. The
    products take the operands' dtype; the gradient sums, the softmax's and D's in the compute
    dtype.
    """
    n, tp, dim = qu.shape
    op, work = qu.dtype, compute_dtype(qu.dtype)
    same = op == work
    bk, sub = plan.block, plan.sub
    masks = _masks(plan, op, qu.device)
    gram = _diagonal_gram(qc, vu, plan, masks)
    neg_grad_gram = torch.zeros(gram.shape, dtype=work, device=gram.device)
    delta = (grad_out.to(work) * out.to(work)).sum(dim=-1)
    dqu, dku, dvu, dqc, dkc, dvc = (torch.zeros(qu.shape, dtype=work, device=qu.device) for _ in range(6))
    dqc_subs, dvu_subs = _subs(dqc, plan), _subs(dvu, plan)
    qc_subs, vu_subs = _subs(qc, plan), _subs(vu, plan)
    for j in range(plan.n_blocks):
        stop = _stop(plan, docs, j)
        kb = _key_block(j, qu, ku, vu, qc, gram, plan, masks, stop)
        near, s0 = kb.near, j * bk // sub
        r0, r1, c1 = j * bk, (j + 1) * bk, j * bk + near * sub
        near_subs = slice(s0, s0 + near)
        # Softmax and causal-key part, as in flash attention.
        probs = _scores(j, kb, qc, kc, plan, masks, docs, stop).sub_(lse[:, r0:stop].unsqueeze(-1)).exp_()
        probs_op = probs if same else probs.to(op)
        dvc[:, r0:r1] = torch.bmm(probs_op.transpose(1, 2), grad_out[:, r0:stop])
        grad_score = torch.bmm(grad_out[:, r0:stop], vc[:, r0:r1].transpose(1, 2)).to(work)
        grad_score.sub_(delta[:, r0:stop].unsqueeze(-1)).mul_(probs)
        del probs, probs_op
        grad_score_op = grad_score if same else grad_score.to(op)
        if same:
            dqc[:, r0:stop].baddbmm_(grad_score, kc[:, r0:r1])
        else:
            dqc[:, r0:stop].add_(torch.bmm(grad_score_op, kc[:, r0:r1]))
        dkc[:, r0:r1] = torch.bmm(grad_score_op.transpose(1, 2), qc[:, r0:stop])
        neg_grad_su = torch.ops.aten.silu_backward(grad_score, kb.s_u.to(work))
        del grad_score, grad_score_op
        if not same:
            neg_grad_su = neg_grad_su.to(op)
        neg_near = neg_grad_su[:, : near * sub].view(n, near, sub, bk)
        # D term of the near row sub-blocks, and of all rows beyond (which see the total).
        dqc_subs[:, near_subs].sub_(neg_near @ kb.d_excl_op)  # sub_, not -=: no write-back copy
        neg_grad_d = (neg_near.transpose(-1, -2) @ qc_subs[:, near_subs]).to(work)  # [N, near, block_b, d]
        # D_J^(I) = sum_{I' < I} Y_I'  =>  dY_I' = sum_{I > I'} dD_J^(I) (+ the rows beyond):
        # a reverse exclusive scan, which like the forward only adds.
        neg_grad_y = _exclusive_scan(neg_grad_d.view(n, near, bk * dim), masks, reverse=True).view(n, near, bk, dim)
        if c1 < stop:
            neg_far = neg_grad_su[:, near * sub :]
            if same:
                dqc[:, c1:stop].baddbmm_(neg_far, kb.d_total, alpha=-1)
            else:
                dqc[:, c1:stop].sub_(torch.bmm(neg_far, kb.d_total_op))
            neg_grad_y += torch.bmm(neg_far.transpose(1, 2), qc[:, c1:stop]).unsqueeze(1)
        neg_grad_y_op = neg_grad_y if same else neg_grad_y.to(op)
        # Y_I = P[J, I] VU_I and the diagonal term G_I P[J, I]^T.
        neg_grad_p = neg_grad_y_op @ vu_subs[:, near_subs].transpose(-1, -2)  # [N, near, block_b, sub_c]
        neg_grad_p += neg_near.transpose(-1, -2) @ gram[:, near_subs]
        dvu_subs[:, near_subs].sub_(kb.p.transpose(-1, -2) @ neg_grad_y_op)
        neg_grad_gram[:, near_subs].add_(neg_near @ kb.p)
        # P = sigmoid(Z) * mask: P is 0 wherever the mask is, so P (1 - P) carries the mask.
        neg_grad_z = torch.ops.aten.sigmoid_backward(neg_grad_p, kb.p).transpose(1, 2).reshape(n, bk, near * sub)
        dqu[:, r0:r1] = torch.bmm(neg_grad_z, ku[:, r0:c1]).neg_()
        if same:
            dku[:, r0:c1].baddbmm_(neg_grad_z.transpose(1, 2), qu[:, r0:r1], alpha=-1)
        else:
            dku[:, r0:c1].sub_(torch.bmm(neg_grad_z.transpose(1, 2), qu[:, r0:r1]))
    neg_grad_gram.mul_(masks.tril)
    neg_grad_gram = neg_grad_gram if same else neg_grad_gram.to(op)
    dqc_subs -= neg_grad_gram @ vu_subs
    dvu_subs -= neg_grad_gram.transpose(-1, -2) @ qc_subs
    return dqu, dku, dvu, dqc, dkc, dvc


# The training path is a pair of custom ops (torch.library): torch.compile keeps them as they
# are, so a compiled CASTLE block runs the same kernels as an eager one.


@custom_op("castle_attention")
def castle_attention_forward(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    block_size: int,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, H, d] in the inputs' dtype, logsumexp [B * H, T_padded] in the compute dtype)."""
    plan = _Plan.make(qu.shape[1], block_size, window, scale)
    docs = _Documents.make(document_ids, plan, qu.shape[2])
    packed = _pack_all((qu, ku, vu, qc, kc, vc), plan, operand_dtype(qu.dtype, qu.device))
    out, lse, _ = _forward(*packed, plan, docs=docs)
    return _unpack(out, plan, qu.shape, qu.dtype), lse


@castle_attention_forward.register_fake
def _(qu, ku, vu, qc, kc, vc, window, scale, block_size, document_ids=None):
    plan = _Plan.make(qu.shape[1], block_size, window, scale)
    batch, _, heads, _ = qu.shape
    return qu.new_empty(qu.shape), qu.new_empty(batch * heads, plan.padded, dtype=compute_dtype(qu.dtype))


@custom_op("castle_attention_backward")
def castle_attention_backward(
    grad_out: torch.Tensor,
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int | None,
    scale: float,
    block_size: int,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `castle_attention_forward` w.r.t. its six inputs, in their dtype."""
    plan = _Plan.make(qu.shape[1], block_size, window, scale)
    docs = _Documents.make(document_ids, plan, qu.shape[2])
    dtype = operand_dtype(qu.dtype, qu.device)
    packed = _pack_all((qu, ku, vu, qc, kc, vc), plan, dtype)
    grads = _backward(*packed, _pack(out, plan, dtype), lse, _pack(grad_out, plan, dtype), plan, docs)
    # The packed qu and qc were pre-scaled, so their gradients carry one more factor.
    grads[0].mul_(plan.scale)
    grads[3].mul_(plan.scale)
    return tuple(_unpack(g, plan, qu.shape, qu.dtype) for g in grads)


@castle_attention_backward.register_fake
def _(grad_out, qu, ku, vu, qc, kc, vc, out, lse, window, scale, block_size, document_ids=None):
    return tuple(qu.new_empty(qu.shape) for _ in range(6))


def _setup_context(ctx, inputs, output) -> None:
    document_ids = inputs[9] if len(inputs) > 9 else None
    ctx.save_for_backward(*inputs[:6], *output, *(() if document_ids is None else (document_ids,)))
    ctx.plan = inputs[6:9]
    ctx.mark_non_differentiable(output[1])


def _backward_rule(ctx, grad_out, _grad_lse):
    qu, ku, vu, qc, kc, vc, out, lse, *document_ids = ctx.saved_tensors
    grads = castle_attention_backward(
        grad_out, qu, ku, vu, qc, kc, vc, out, lse, *ctx.plan, document_ids[0] if document_ids else None
    )
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:6])), None, None, None, None)


castle_attention_forward.register_autograd(_backward_rule, setup_context=_setup_context)


def castle_attention(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    block_size: int,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """CASTLE (window=None) or CASTLE-SWL (window=W >= 1) attention for training.

    All six inputs are [B, T, H, d] with one dtype and device, assumed valid and autocast off
    (`farsight.ops.castle.castle_attention` checks them, resolves `scale` and handles autocast);
    returns o [B, T, H, d] in the input dtype. fp64 computes in fp64 and fp32 in fp32. fp16/bf16
    inputs take their own dtype for every matrix product where the device multiplies it in
    hardware (bf16 on AVX512-BF16/AMX CPUs), with fp32 everywhere else: the running max / sum,
    the logsumexp, the lookahead sums D and the gradient sums are fp32; without those
    instructions everything is fp32. Gradients come back in the input dtype. O(T^2 d) time and
    O(T d + T * block_size) memory in forward and backward. `block_size` is a speed knob
    (clipped to T); results do not depend on it beyond rounding. `document_ids` [B, T] (long,
    assumed valid, None for one document per row): packed rows, see the module docstring.
    """
    return castle_attention_forward(qu, ku, vu, qc, kc, vc, window, scale, block_size, document_ids)[0]


def forward_with_lookahead_keys(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of `castle_attention` without autograd, for the prefill (Algorithm 4).

    Returns (o [B, T, H, d] in the input dtype, U [B, H, T, d] in the compute dtype): U, the
    lookahead keys after all T tokens, are the inclusive totals of the forward's D
    accumulation, so they come out of the same pass (O(T d) memory).
    """
    batch, steps, heads, dim = qu.shape
    plan = _Plan.make(steps, block_size, window, scale)
    with torch.no_grad():
        packed = _pack_all((qu, ku, vu, qc, kc, vc), plan, compute_dtype(qu.dtype))
        out, _, lookahead = _forward(*packed, plan, want_lookahead=True)
    u = lookahead.view(batch, heads, plan.padded, dim)[:, :, :steps]
    return _unpack(out, plan, qu.shape, qu.dtype), u
