"""Naive grouped cross-attention: gather every retrieved chunk, einsum, plain autograd.

This is the readable definition the efficient paths are tested against. It materialises the
gathered keys/values [B, n, K, S, H, d] and autograd keeps them (and the [B, n, K, H, Lq, S]
probabilities) for the backward, so it is only meant for tests and small inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from farsight.ops.checks import compute_dtype


def gca_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    softmax_one: bool = True,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K] -> o [B, n, Lq, H, d].

    o[b, t] = sum_k weight[b, t, k] * softmax_x(scale * q[b, t] K_c^T) V_c with c = index[b, t, k],
    per head over the S rows of chunk c; slots with index -1 add nothing. softmax_x is softmax
    off by one (an extra zero logit in the denominator) when `softmax_one`, else softmax.
    key_mask [B, n, K, S] (True = real key) removes keys from slot k's softmax; a slot whose keys
    are all masked adds zero.
    Inputs are assumed valid (`farsight.ops.gca.gca` checks them).
    """
    batch, _, _, _, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    work = compute_dtype(q.dtype)
    # A zero chunk in front of the memory lets empty slots (-1) gather it like any other chunk:
    # its output is exactly zero, and masking the weight below removes its gradient.
    zero = k.new_zeros(batch, 1, *k.shape[2:])
    rows = torch.arange(batch, device=q.device)[:, None, None]
    keys = torch.cat([zero, k], dim=1).to(work)[rows, index + 1]  # [B, n, K, S, H, d]
    values = torch.cat([zero, v], dim=1).to(work)[rows, index + 1]

    scores = torch.einsum("btqhd,btkshd->btkhqs", q.to(work), keys) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, :, :, None, None, :], float("-inf"))
    if softmax_one:
        scores = F.pad(scores, (0, 1))
    # nan_to_num: a slot with every key masked (softmax of all -inf) reads nothing
    probs = scores.softmax(dim=-1).nan_to_num(0.0)
    if softmax_one:
        probs = probs[..., :-1]
    per_chunk = torch.einsum("btkhqs,btkshd->btkqhd", probs, values)
    w = torch.where(index >= 0, weight.to(work), 0.0)
    return torch.einsum("btk,btkqhd->btqhd", w, per_chunk).to(q.dtype)
