"""Grouped cross-attention for any device with a recomputing backward (no gathered copies kept).

The reference gathers all K retrieved chunks at once and autograd keeps that [B, n, K, S, H, d]
copy (twice, for keys and values) plus the probabilities. Here the forward walks the K slots one
at a time, so at most one gathered [B, n, S, H, d] chunk per slot is alive, and saves only the
inputs and one logsumexp per (slot, head, query row). The backward re-gathers each slot,
rebuilds its probabilities from the logsumexp and scatters the chunk gradients back through the
index, so chunks retrieved by several query chunks (or twice by one) accumulate correctly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from farsight.ops.checks import compute_dtype
from farsight.ops.precision import amp_function


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, n, L, H, d] -> [B, n, H, L, d] (a view): the layout batched matmuls take without copies."""
    return x.permute(0, 1, 3, 2, 4)


def _gather(x: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """x [B, m, ...] (any strides), chunk [B, *idx] (valid ids) -> [B, *idx, ...]: the chunks each
    row of the batch reads, e.g. [B, m, H, S, d] by [B, n] -> [B, n, H, S, d]."""
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *[1] * (chunk.dim() - 1))
    return x[rows, chunk]


def _logsumexp(scores: torch.Tensor, softmax_one: bool) -> torch.Tensor:
    """Softmax normaliser over the last dim, kept finite when every score is -inf (all keys
    masked) so that exp(score - lse) is exactly zero there instead of NaN.

    The logsumexp of softmax_1 includes the implicit zero logit (logaddexp with 0), so that
    exp(score - lse) is softmax_1 directly and the backward can rebuild it from the saved value.
    """
    lse = torch.logsumexp(scores, dim=-1)
    if softmax_one:
        return torch.logaddexp(lse, torch.zeros((), dtype=lse.dtype, device=lse.device))
    return lse.clamp_min(torch.finfo(lse.dtype).min)


def _scaled_heads_first(q: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * q [B, n, Lq, H, d] -> [B, n, H, Lq, d], contiguous: every slot's matmuls read it
    without a copy, and the scores come out of them already scaled."""
    batch, n, lq, heads, dim = q.shape
    return torch.mul(_heads_first(q), scale, out=q.new_empty(batch, n, heads, lq, dim))


def _probs(
    qs: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor | None, softmax_one: bool, mask: torch.Tensor | None
):
    """qs [B, n, H, Lq, d] (pre-scaled), keys [B, n, H, S, d] (one dtype), mask [B, n, S] (True
    = real key) or None -> probabilities [B, n, H, Lq, S] and logsumexp [B, n, H, Lq], both in the
    compute dtype. fp16/bf16 products accumulate in fp32 inside the matmul and come out rounded
    to the operands' dtype once (as in eager bf16 attention); everything after is fp32."""
    scores = torch.matmul(qs, keys.transpose(-1, -2)).to(compute_dtype(qs.dtype))
    if mask is not None:
        scores.masked_fill_(~mask[:, :, None, None, :], float("-inf"))
    if lse is None:
        lse = _logsumexp(scores, softmax_one)
    return scores.sub_(lse[..., None]).exp_(), lse


class _GCARecompute(torch.autograd.Function):
    """Matmul operands in q's dtype (their fp16/bf16 results, the scores and dO V^T among them,
    rounded to it once); probabilities, softmax statistics, the weights and every gradient sum
    in the compute dtype. Slot j's weight w_j is folded into its probabilities."""

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
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, n, lq, heads, dim = q.shape
        n_slots = index.shape[2]
        work = compute_dtype(q.dtype)
        qs, kh, vh = _scaled_heads_first(q, scale), _heads_first(k), _heads_first(v)
        valid = index >= 0
        chunk = index.clamp(min=0)
        w = torch.where(valid, weight.to(work), 0.0)[..., None, None, None]  # [B, n, K, 1, 1, 1]
        out = torch.zeros(batch, n, heads, lq, dim, dtype=work, device=q.device)
        lse = torch.zeros(n_slots, batch, n, heads, lq, dtype=work, device=q.device)
        # With no memory at all every slot is empty (checked by `gca`): the output is zero.
        for j in range(n_slots if k.shape[1] > 0 else 0):
            # Empty slots read chunk 0 and are multiplied by a zero weight: exact zeros, no branch.
            mask = None if key_mask is None else key_mask[:, :, j]
            probs, lse[j] = _probs(qs, _gather(kh, chunk[:, :, j]), None, softmax_one, mask)
            out.add_(torch.matmul(probs.mul_(w[:, :, j]).to(q.dtype), _gather(vh, chunk[:, :, j])))
        ctx.save_for_backward(q, k, v, index, weight, lse, key_mask)
        ctx.softmax_one, ctx.scale = softmax_one, scale
        return out.permute(0, 1, 3, 2, 4).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, index, weight, lse, key_mask = ctx.saved_tensors
        need_q, need_k, need_v, _, need_w = ctx.needs_input_grad[:5]
        batch, n, _, heads, dim = q.shape
        m, s = k.shape[1], k.shape[2]
        low, work = q.dtype, compute_dtype(q.dtype)
        qs, kh, vh = _scaled_heads_first(q, ctx.scale), _heads_first(k), _heads_first(v)
        go = _heads_first(grad_out).contiguous()  # dO [B, n, H, Lq, d], q's dtype
        valid = index >= 0
        chunk = index.clamp(min=0)
        w = torch.where(valid, weight.to(work), 0.0)[..., None, None, None]
        dqs = torch.zeros(batch, n, heads, q.shape[2], dim, dtype=work, device=q.device)
        # Chunk gradients are scattered into a flat [B * m, H, S, d] view: row b * m + c.
        dk = torch.zeros(batch * m, heads, s, dim, dtype=work, device=q.device)
        dv = torch.zeros_like(dk)
        dw = torch.zeros(batch, n, index.shape[2], dtype=work, device=q.device)
        flat = chunk + torch.arange(batch, device=q.device)[:, None, None] * m
        for j in range(index.shape[2] if m > 0 else 0):
            keys, values = _gather(kh, chunk[:, :, j]), _gather(vh, chunk[:, :, j])
            mask = None if key_mask is None else key_mask[:, :, j]
            probs, _ = _probs(qs, keys, lse[j], ctx.softmax_one, mask)  # P, unweighted
            if need_q or need_k or need_w:
                dp = torch.matmul(go, values.transpose(-1, -2)).to(work)  # dO V^T
                # r = <dO, P V> per row = rowsum(P * dO V^T) (flash attention's delta): dL/dw_j
                # sums it, and with softmax's Jacobian (softmax_1's extra 1 is a constant)
                # dL/dscores = w_j P * (dO V^T - r).
                r = (probs * dp).sum(dim=-1, keepdim=True)
                dw[:, :, j] = r.sum(dim=(2, 3, 4))
            weighted = probs.mul_(w[:, :, j])
            if need_v:
                dv_j = torch.matmul(weighted.to(low).transpose(-1, -2), go)
                dv.index_add_(0, flat[:, :, j].reshape(-1), dv_j.reshape(batch * n, heads, s, dim).to(work))
            if need_q or need_k:
                ds = dp.sub_(r).mul_(weighted).to(low)
                if need_q:
                    dqs.add_(torch.matmul(ds, keys))
                if need_k:
                    dk_j = torch.matmul(ds.transpose(-1, -2), qs)
                    dk.index_add_(0, flat[:, :, j].reshape(-1), dk_j.reshape(batch * n, heads, s, dim).to(work))
        dw = torch.where(valid, dw, 0.0)
        return (
            dqs.mul_(ctx.scale).permute(0, 1, 3, 2, 4).to(q.dtype) if need_q else None,
            dk.view(batch, m, heads, s, dim).permute(0, 1, 3, 2, 4).to(k.dtype) if need_k else None,
            dv.view(batch, m, heads, s, dim).permute(0, 1, 3, 2, 4).to(v.dtype) if need_v else None,
            None,
            dw.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
        )


def _gca_no_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool,
    scale: float,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Inference form: all K slots in one gather, two batched matmuls and one fused softmax.

    The K retrieved chunks sit side by side ([.., Lq, K, S']), and with softmax_1 every chunk is
    followed by a zero key (S' = S + 1): its logit is exactly softmax_1's implicit zero, so a
    plain softmax over each S'-column group is softmax_1, and its zero value row adds nothing.
    `scale` is folded into q and each slot's fusion weight into its gathered values, so the score
    tile only passes through the two matmuls, the optional mask and the softmax. The matmuls
    take q's dtype (fp16/bf16 accumulate in fp32 inside and round the scores to that dtype once),
    the weights multiply in fp32 (v * w is rounded once) and the softmax keeps its max and sum
    in fp32 (docs/design.md §6). Without a backward nothing is saved, so the gathered [B, n, H, K, S', d]
    keys and values cost only their (segment-sized) temporaries.
    """
    batch, n, lq, heads, dim = q.shape
    n_slots, s = index.shape[2], k.shape[2]
    width = s + 1 if softmax_one else s
    valid = index >= 0
    if key_mask is not None:
        # A slot with no real key adds nothing, like an empty one. Its keys stay unmasked so
        # that its softmax has something to normalise (no NaN); the zero weight removes it.
        has_key = key_mask.any(dim=-1)
        valid = valid & has_key
        key_mask = key_mask | ~has_key[..., None]
    w = torch.where(valid, weight.to(compute_dtype(q.dtype)), 0.0)  # fp32 (fp64): v * w is rounded once
    chunk = index.clamp(min=0)

    def gathered(x: torch.Tensor, slot_weight: torch.Tensor | None) -> torch.Tensor:
        # [B, m, S, H, d] -> [B, n, H, K * S', d], zero in every chunk's extra row
        out = x.new_empty(batch, n, heads, n_slots, width, dim)
        part = _gather(x, chunk).permute(0, 1, 4, 2, 3, 5)  # [B, n, H, K, S, d]
        if slot_weight is None:
            out[..., :s, :] = part
        else:
            torch.mul(part, slot_weight[:, :, None, :, None, None], out=out[..., :s, :])
        out[..., s:, :] = 0
        return out.view(batch, n, heads, n_slots * width, dim)

    keys, values = gathered(k, None), gathered(v, w)
    scores = torch.matmul(_scaled_heads_first(q, scale), keys.transpose(-1, -2))
    scores = scores.view(batch, n, heads, lq, n_slots, width)
    if key_mask is not None:
        scores[..., :s].masked_fill_(~key_mask[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, n, heads, lq, n_slots * width)
    return torch.matmul(probs, values).permute(0, 1, 3, 2, 4)


def gca_recompute(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool = True,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K], key_mask [B, n, K, S] or
    None -> o [B, n, Lq, H, d].

    Same result as `gca_reference`. Without gradients (inference) all K slots run in one batched
    pass (`_gca_no_grad`). Saved for the backward: the inputs and a logsumexp of shape
    [K, B, n, H, Lq]; peak extra memory is one gathered chunk per slot ([B, n, S, H, d]) and its
    [B, n, H, Lq, S] probabilities. The matmuls take q's dtype: fp16/bf16 products accumulate in
    fp32 inside and are rounded to that dtype once (the scores and, in the backward, dO V^T; as
    in eager bf16 attention), and `scale` is folded into q. The softmax statistics, the fusion
    with the weights (fp32 whatever their dtype) and the gradient sums are fp32 (fp64 for fp64).
    The output has q's dtype. Inputs are assumed
    valid and autocast off (`farsight.ops.gca.gca` sees to both).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if k.shape[1] > 0 and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, weight))):
        return _gca_no_grad(q, k, v, index, weight, softmax_one, scale, key_mask)
    return amp_function(_GCARecompute, q.device.type).apply(q, k, v, index, weight, softmax_one, scale, key_mask)
