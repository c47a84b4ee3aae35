"""CASTLE ground truth: the recurrent definition and the dense parallel form (Theorem 1).

Both are slow on purpose and exist to test the blockwise path, so they share no code with it
(each writes its own masks); their inputs are assumed valid (`farsight.ops.castle` checks them
and resolves `scale`). All six inputs are [B, T, H, d]; positions are 0-based. With `window` W
(CASTLE-SWL, None = CASTLE), the lookahead key of token s after tokens 0..t have been seen is

    U^t[s] = sum_{c : s < c <= t, c <= s + W} sigmoid(scale * qu_s . ku_c) * vu_c

and output row t is softmax_s(scale * qc_t . kc_s - SiLU(scale * qc_t . U^t[s])) @ vc, s <= t.

With `document_ids` [B, T] (packed rows; `farsight.ops.documents`), query t attends key s only
when doc(s) == doc(t). The recurrent form says so literally: U^t[s] sums only lookahead tokens
c of s's own document, and the score of a key of another document is -inf. The parallel form
masks the [query, key] score alone, which is the same thing: documents are contiguous, so
doc(s) == doc(t) puts every c with s < c <= t in that document too (test_castle_documents.py
checks the two against each other).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from farsight.ops.checks import compute_dtype
from farsight.ops.documents import same_document


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.transpose(1, 2).to(dtype)


def castle_recurrent(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Literal recurrent CASTLE: a loop over t that forms U^t explicitly (O(T^3 d); T <= ~130).

    Inputs [B, T, H, d]; returns o [B, T, H, d] in the input dtype (computed in fp32, or fp64
    for fp64 inputs). Differentiable through plain autograd. `document_ids` [B, T] (or None):
    a token sees, and its lookahead key sums, only tokens of its own document.
    """
    dtype = compute_dtype(qu.dtype)
    qu_, ku_, vu_, qc_, kc_, vc_ = (_heads_first(x, dtype) for x in (qu, ku, vu, qc, kc, vc))
    steps = qu.shape[1]
    # takes[s, c]: U^t[s] sums token c when s < c (c <= t: the tokens seen) and c <= s + W
    position = torch.arange(steps, device=qu.device)
    s, c = position[:, None], position[None, :]
    takes = (s < c) & (c <= s + window) if window is not None else s < c
    # same[b, s, c]: s and c are tokens of one document (everywhere without documents)
    same = torch.ones(1, steps, steps, dtype=torch.bool, device=qu.device)
    if document_ids is not None:
        same = same_document(document_ids, document_ids)
    takes = takes & same  # [B or 1, T, T]: U^t[s] sums only tokens of s's document
    rows = []
    for t in range(steps):
        seen = slice(0, t + 1)
        weights = torch.sigmoid(scale * qu_[..., seen, :] @ ku_[..., seen, :].transpose(-1, -2))
        u_t = (weights * takes[:, None, seen, seen]) @ vu_[..., seen, :]  # [B, H, t + 1, d], last row 0
        q_t = qc_[..., t : t + 1, :]
        score = scale * q_t @ kc_[..., seen, :].transpose(-1, -2) - F.silu(scale * q_t @ u_t.transpose(-1, -2))
        score = score.masked_fill(~same[:, None, t : t + 1, seen], float("-inf"))  # keys of other documents
        rows.append(torch.softmax(score, dim=-1) @ vc_[..., seen, :])
    if not rows:
        return qu.new_empty(qu.shape)
    return torch.cat(rows, dim=-2).transpose(1, 2).to(qu.dtype)


def castle_parallel_reference(
    qu: torch.Tensor,
    ku: torch.Tensor,
    vu: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    window: int | None,
    scale: float,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Theorem 1 with dense [T, T] matrices (eq. 11 is an O(T^3) matrix product); plain autograd.

    S^U = (scale * QC VU^T * [a >= c]) @ (sigmoid(scale * QU KU^T) * [b < c <= b + W])^T,
    O = row_softmax(scale * QC KC^T + causal mask - SiLU(S^U)) VC.
    Inputs [B, T, H, d]; returns o [B, T, H, d] in the input dtype. With `document_ids` [B, T]
    the causal mask also requires doc(a) == doc(b), and that is the whole change (the module
    docstring says why S^U needs no mask of its own).
    """
    dtype = compute_dtype(qu.dtype)
    qu_, ku_, vu_, qc_, kc_, vc_ = (_heads_first(x, dtype) for x in (qu, ku, vu, qc, kc, vc))
    steps = qu.shape[1]
    causal = torch.ones(steps, steps, dtype=torch.bool, device=qu.device).tril()
    # [b < c <= b + W]: key b absorbs the tokens after it, up to W of them (all without a window)
    width = steps if window is None else window
    b, c = torch.arange(steps, device=qu.device)[:, None], torch.arange(steps, device=qu.device)[None, :]
    lookahead = torch.sigmoid(scale * qu_ @ ku_.transpose(-1, -2)) * ((b < c) & (c <= b + width))
    s_u = (scale * qc_ @ vu_.transpose(-1, -2) * causal) @ lookahead.transpose(-1, -2)
    allowed = causal if document_ids is None else causal & same_document(document_ids, document_ids)[:, None]
    score = (scale * qc_ @ kc_.transpose(-1, -2) - F.silu(s_u)).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(score, dim=-1) @ vc_).transpose(1, 2).to(qu.dtype)
