"""Grouped cross-attention for any device: all K slots in one gathered pass (PyTorch).

The K retrieved chunks of a query chunk sit side by side ([.., Lq, K, S']), and with softmax_1
every chunk is followed by a zero key (S' = S + 1): its logit is exactly softmax_1's implicit
zero, so a plain softmax over each S'-column group is softmax_1, and its zero value row adds
nothing. Each slot's fusion weight w is folded into its gathered values (forward) and keys
(backward), so the score tile passes through two batched matmuls, the optional mask and one
fused softmax (ATen's, fp32 inside) forward, and one matmul and one fused softmax backward
backward. Training keeps the probabilities ([B, H, n, Lq, K, S'] in q's dtype, linear in the
sequence) instead of the gathered [B, n, K, S, H, d] keys and values; the backward gathers
again and scatters the chunk gradients back through the index, so chunks retrieved by several
query chunks (or twice by one) accumulate correctly.

The training path is a pair of custom ops (torch.library): torch.compile keeps them as they
are, and a compiled DRT block runs the same kernels as an eager one.
"""

from __future__ import annotations

import torch

from farsight.ops.checks import compute_dtype
from farsight.ops.library import custom_op
from farsight.ops.precision import software_matmul_dtypes


def _heads_outer(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x [B, n, L, H, d] -> [B, H, n, L, d], contiguous (one copy): heads outermost, so
    that the gathered chunks of every (batch, head) sit in whole [S', d] blocks."""
    batch, n, length, heads, dim = x.shape
    out = x.new_empty(batch, heads, n, length, dim)
    return out.copy_(x.permute(0, 3, 1, 2, 4)) if scale == 1.0 else torch.mul(x.permute(0, 3, 1, 2, 4), scale, out=out)


def _back(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x [B, H, n, L, d] -> [B, n, L, H, d] (contiguous, one copy)."""
    batch, heads, n, length, dim = x.shape
    out = x.new_empty(batch, n, length, heads, dim)
    return out.copy_(x.permute(0, 2, 3, 1, 4)) if scale == 1.0 else torch.mul(x.permute(0, 2, 3, 1, 4), scale, out=out)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b; as an fp32 GEMM rounded back where the CPU multiplies their dtype in software (a
    dispatch mode such as `widened_matmuls` does not see inside a custom op)."""
    if a.device.type == "cpu" and a.dtype in software_matmul_dtypes(a.device):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


class _Slots:
    """The retrieval slots of one call: which are real, their weights, and the gathered chunks.

    Layouts are heads-outer: q rows [B, H, n, Lq, d], gathered chunks [B, H, n, K * S', d]."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        index: torch.Tensor,
        weight: torch.Tensor,
        softmax_one: bool,
        key_mask: torch.Tensor | None,
    ) -> None:
        self.batch, self.n, self.lq, self.heads, self.dim = q.shape
        self.m, self.n_slots, self.s = k.shape[1], index.shape[2], k.shape[2]
        self.width = self.s + 1 if softmax_one else self.s
        valid = index >= 0
        if key_mask is not None:
            # A slot with no real key adds nothing, like an empty one. Its keys stay unmasked so
            # that its softmax has something to normalise (no NaN); the zero weight removes it.
            has_key = key_mask.any(dim=-1)
            valid = valid & has_key
            key_mask = key_mask | ~has_key[..., None]
        self.valid, self.key_mask = valid, key_mask
        # fp32 (fp64) whatever weight's dtype: x * w is rounded once
        self.w = torch.where(valid, weight.to(compute_dtype(q.dtype)), 0.0)
        self._slot_weight = self.w[:, None, :, :, None, None]  # [B, 1, n, K, 1, 1]
        # Row of each slot's chunk in the chunks laid out [B * H * m, S' * d], per (b, h):
        # [B * H * n * K], in the order of the gathered [B, H, n, K, S', d]
        batch_head = torch.arange(self.batch * self.heads, device=q.device).view(self.batch, self.heads, 1, 1)
        self._rows = (batch_head * self.m + index.clamp(min=0)[:, None]).reshape(-1)

    def gathered(self, x: torch.Tensor, weighted: bool = False) -> torch.Tensor:
        """[B, m, S, H, d] -> [B, H, n, K * S', d] (times each slot's weight if `weighted`), zero
        in every chunk's extra row: one copy of x into the padded heads-outer layout, then whole
        [S', d] blocks gathered as rows (index_select copies each row whole, faster on the CPU
        than advanced indexing over three dimensions)."""
        batch, heads, s, dim = self.batch, self.heads, self.s, self.dim
        padded = x.new_empty(batch, heads, self.m, self.width, dim)
        padded[..., :s, :].copy_(x.permute(0, 3, 1, 2, 4))
        padded[..., s:, :].zero_()
        out = padded.view(-1, self.width * dim).index_select(0, self._rows)
        out = out.view(batch, heads, self.n, self.n_slots, self.width, dim)
        if weighted:
            out.mul_(self._slot_weight)
        return out.view(batch, heads, self.n, self.n_slots * self.width, dim)

    def probabilities(self, qh: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Per-slot softmax(_1) [B, H, n, Lq, K, S'] of qh keys^T (qh pre-scaled), in their dtype."""
        scores = _matmul(qh, keys.transpose(-1, -2))
        scores = scores.view(self.batch, self.heads, self.n, self.lq, self.n_slots, self.width)
        if self.key_mask is not None:
            scores[..., : self.s].masked_fill_(~self.key_mask[:, None, :, None], float("-inf"))
        return torch.softmax(scores, dim=-1)

    def scatter(self, grads: torch.Tensor, work: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
        """Per-slot chunk gradients [B, H, n, K * S', d] -> w times their sum per memory chunk,
        [B, m, S, H, d] in `dtype` (summed in `work`). `grads` is a temporary of the caller's:
        where it has the compute dtype already, w multiplies it in place."""
        batch, heads, m, width, dim = self.batch, self.heads, self.m, self.width, self.dim
        grads = grads.view(batch, heads, self.n, self.n_slots, width, dim)
        per_slot = grads.mul_(self._slot_weight) if grads.dtype == work else grads * self._slot_weight
        total = torch.zeros(batch * heads * m, width * dim, dtype=work, device=grads.device)
        total.index_add_(0, self._rows, per_slot.reshape(-1, width * dim))
        keys = total.view(batch, heads, m, width, dim)[..., : self.s, :].permute(0, 2, 3, 1, 4)
        return torch.empty(keys.shape, dtype=dtype, device=keys.device).copy_(keys)


@custom_op("gca_recompute")
def gca_recompute_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool,
    scale: float,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, n, Lq, H, d], probabilities [B, H, n, Lq, K, S'] for the backward), in q's dtype."""
    slots = _Slots(q, k, index, weight, softmax_one, key_mask)
    if k.shape[1] == 0:  # no memory at all: every slot is empty (checked by `gca`), the output is zero
        shape = (slots.batch, slots.heads, slots.n, slots.lq, slots.n_slots, slots.width)
        return torch.zeros_like(q), q.new_zeros(shape)
    probs = slots.probabilities(_heads_outer(q, scale), slots.gathered(k))
    flat = probs.view(slots.batch, slots.heads, slots.n, slots.lq, -1)
    return _back(_matmul(flat, slots.gathered(v, weighted=True))), probs


@gca_recompute_forward.register_fake
def _(q, k, v, index, weight, softmax_one, scale, key_mask):
    batch, n, lq, heads, _ = q.shape
    width = k.shape[2] + 1 if softmax_one else k.shape[2]
    return q.new_empty(q.shape), q.new_empty(batch, heads, n, lq, index.shape[2], width)


@custom_op("gca_recompute_backward")
def gca_recompute_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    probs: torch.Tensor,
    key_mask: torch.Tensor | None,
    softmax_one: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `gca_recompute_forward` with respect to q, k, v and weight.

    With P_j the unweighted softmax of slot j and o = sum_j w_j P_j V_j: dV_j = w_j P_j^T dO,
    dS_j = w_j P_j * (dO V_j^T - r_j) with r_j = rowsum(P_j * dO V_j^T) (one fused softmax
    backward over all slots, w_j folded into the keys of dq and onto dk), and dL/dw_j = the sum
    of r_j over rows and heads."""
    work = compute_dtype(q.dtype)
    slots = _Slots(q, k, index, weight, softmax_one, key_mask)
    if slots.m == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(weight)
    batch, heads, n, lq, n_slots, width = probs.shape
    go = _heads_outer(grad_out.to(q.dtype))  # dO [B, H, n, Lq, d]
    flat_probs = probs.view(batch, heads, n, lq, n_slots * width)
    grad_probs = _matmul(go, slots.gathered(v).transpose(-1, -2)).view(probs.shape)  # dO V^T, unweighted
    # r_j per row and slot (products and row sums rounded to q's dtype, each sum accumulated in
    # the compute dtype), summed over heads and rows in the compute dtype
    dw = torch.mul(probs, grad_probs).sum(dim=-1).sum(dim=(1, 3), dtype=work)  # [B, n, K]
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    del grad_probs
    flat_scores = grad_scores.view(batch, heads, n, lq, n_slots * width)
    dq = _back(_matmul(flat_scores, slots.gathered(k, weighted=True)), scale)
    dk = slots.scatter(_matmul(flat_scores.transpose(-1, -2), _heads_outer(q, scale)), work, k.dtype)
    del grad_scores, flat_scores
    dv = slots.scatter(_matmul(flat_probs.transpose(-1, -2), go), work, v.dtype)
    return dq, dk, dv, torch.where(slots.valid, dw, 0.0).to(weight.dtype)


@gca_recompute_backward.register_fake
def _(grad_out, q, k, v, index, weight, probs, key_mask, softmax_one, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, index, weight, softmax_one, scale, key_mask = inputs
    ctx.save_for_backward(q, k, v, index, weight, output[1], key_mask)
    ctx.softmax_one, ctx.scale = softmax_one, scale
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_probs):
    q, k, v, index, weight, probs, key_mask = ctx.saved_tensors
    grads = gca_recompute_backward(grad_out, q, k, v, index, weight, probs, key_mask, ctx.softmax_one, ctx.scale)
    need = ctx.needs_input_grad
    dq, dk, dv, dw = (g if need[i] else None for g, i in zip(grads, (0, 1, 2, 4)))
    return dq, dk, dv, None, dw, None, None, None


gca_recompute_forward.register_autograd(_backward, setup_context=_setup_context)


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
    """Inference form: the forward above with nothing saved, so the gathered [B, n, H, K, S', d]
    keys and values cost only their (segment-sized) temporaries. The matmuls take q's dtype
    (fp16/bf16 accumulate in fp32 inside and round the scores to that dtype once), the weights
    multiply in fp32 (v * w is rounded once) and the softmax keeps its max and sum in fp32
    (docs/design.md §6)."""
    slots = _Slots(q, k, index, weight, softmax_one, key_mask)
    probs = slots.probabilities(_heads_outer(q, scale), slots.gathered(k))
    flat = probs.view(slots.batch, slots.heads, slots.n, slots.lq, -1)
    return _back(torch.matmul(flat, slots.gathered(v, weighted=True)))


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

    Same result as `gca_reference` (module doc: all K slots in one gathered pass). Saved for the
    backward: the inputs and the probabilities [B, H, n, Lq, K, S'] in q's dtype. The matmuls take
    q's dtype: fp16/bf16 products accumulate in fp32 inside and are rounded to that dtype once
    (the scores and, in the backward, dO V^T; as in eager bf16 attention), and `scale` is folded
    into q; the keys and values a slot's weight multiplies are rounded once. The softmax
    statistics (inside ATen's fused softmax and its backward), the weights (fp32 whatever their
    dtype) and the gradient sums over slots and chunks are fp32 (fp64 for fp64). The output has
    q's dtype. Inputs are assumed valid and autocast off (`farsight.ops.gca.gca` sees to both).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if k.shape[1] > 0 and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, weight))):
        return _gca_no_grad(q, k, v, index, weight, softmax_one, scale, key_mask)
    return gca_recompute_forward(q, k, v, index, weight, softmax_one, scale, key_mask)[0]
