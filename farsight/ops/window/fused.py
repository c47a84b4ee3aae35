"""Sliding-window attention through PyTorch's fused kernels: FlexAttention and SDPA.

`sliding_window_attention_flex` describes the window (and key padding, and document boundaries)
as a FlexAttention block mask and ALiBi as a score_mod, so the compiled kernel skips every key
block outside the band (or wholly in other documents): O(T * W) work, O(T) memory, with its own
fused backward. FlexAttention has no backward on CPU and is slow uncompiled, so
`farsight.ops.window` only dispatches it for CUDA tensors; the uncompiled form (compile=False)
runs forward-only on CPU, which the tests use to check the masks (and `window_mask_mod` runs on
plain index grids, which they compare with the reference mask).

`sliding_window_attention_sdpa` passes a dense [Tq, Tk] mask (additive when ALiBi is on) to
F.scaled_dot_product_attention: any device, but O(Tq * Tk) memory for the mask.

Precision: both take q, k, v in one dtype (fp32, fp16, bf16) and return it; their fused kernels
keep scores and softmax statistics in fp32. ALiBi is added to fp32 scores: FlexAttention's score_mod
sees fp32 scores and reads fp32 slopes; SDPA takes an additive mask only in the query's dtype
(on CUDA an fp32 bias next to bf16 queries is rejected by the memory-efficient kernel and
misread by cuDNN), so with ALiBi fp16/bf16 inputs go through SDPA in fp32.

Positions follow `sliding_window_attention_reference`: query i sits at absolute position
Tk - Tq + i; key j is visible when 0 <= pos - j < window; a query always keeps itself even
when key_padding_mask hides it; with document_ids [B, Tk] (`farsight.ops.documents`) only the
keys of the query's own document are visible.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from farsight.errors import InputError
from farsight.ops.checks import compute_dtype
from farsight.ops.documents import same_document


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@functools.cache
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # Every (Tq, Tk, window, grad mode) compiles its own kernel. Past dynamo's recompile limit
    # (8 by default) the call silently ran FlexAttention eagerly, which materialises the
    # [B, H, Tq, Tk] scores: on an H100 the 9th shape (T=16K) asked for 6 GiB and ran out of
    # memory in the backward. Allow far more shapes than a training or evaluation run meets.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
    return torch.compile(flex_attention, dynamic=False)


def window_mask_mod(
    window: int, offset: int, key_padding_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
):
    """FlexAttention's mask_mod for queries at the last Tq of Tk positions (offset = Tk - Tq):
    True where query q_idx sees key kv_idx. Plain tensor arithmetic, so it also runs on index
    grids outside FlexAttention (the tests compare it with the reference mask that way)."""

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        keep = (distance >= 0) & (distance < window)
        if key_padding_mask is not None:
            keep = keep & (key_padding_mask[b, kv_idx] | (distance == 0))
        if document_ids is not None:
            keep = keep & (document_ids[b, q_idx + offset] == document_ids[b, kv_idx])
        return keep

    return mask_mod


# FlexAttention's tile (query and key rows) and its block mask's granularity: a band of W keys
# computes about (W + BLOCK) / W of its pairs, so smaller tiles waste less at the band's edges
# (1.25x at W=512 with 128, 1.125x with 64) and cost more per tile. torch's default is 128;
# `benchmarks/kernels.py` times the alternatives on a GPU.
FLEX_BLOCK_SIZE = 128


@functools.lru_cache(maxsize=32)
def _band_block_mask(tq: int, tk: int, window: int, device: torch.device, compile_mask: bool, block_size: int):
    """Block mask of the plain band (no padding), cached: training calls repeat one shape."""
    from torch.nn.attention.flex_attention import create_block_mask

    mod = window_mask_mod(window, tk - tq)
    return create_block_mask(mod, None, None, tq, tk, device=device, BLOCK_SIZE=block_size, _compile=compile_mask)


def sliding_window_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    compile: bool = True,
    document_ids: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """q [B, Tq, H, d], k/v [B, Tk, H, d] (Tk >= Tq) -> [B, Tq, H, d] with FlexAttention.

    key_padding_mask [B, Tk] bool (True = real key); document_ids [B, Tk] integer ids of the
    keys' documents (the queries' are the last Tq), None when every row is one document (the
    block mask of the plain band is then cached). Inputs are assumed valid
    (`farsight.ops.window.sliding_window_attention` checks them).
    `compile=False` runs FlexAttention eagerly (a dense fallback: for tests, not for speed).
    `block_size` (default FLEX_BLOCK_SIZE) is the kernel's tile and the block mask's granularity.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tq, tk = q.shape[1], k.shape[1]
    offset = tk - tq
    block_size = FLEX_BLOCK_SIZE if block_size is None else block_size
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise InputError(f"block_size must be a power of two >= 16 (FlexAttention's tile), got {block_size!r}")
    if key_padding_mask is None and document_ids is None:
        block_mask = _band_block_mask(tq, tk, window, q.device, compile, block_size)
    else:
        # per row: the block mask also skips the key blocks that lie wholly in other documents
        mod = window_mask_mod(window, offset, key_padding_mask, document_ids)
        block_mask = create_block_mask(
            mod, q.shape[0], None, tq, tk, device=q.device, BLOCK_SIZE=block_size, _compile=compile
        )
    # the kernel's tiles must divide the block mask's
    options = None if block_size == 128 else {"BLOCK_M": block_size, "BLOCK_N": block_size}
    score_mod = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx)

    attend = _compiled_flex() if compile else flex_attention
    out = attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        kernel_options=options,
    )
    return out.transpose(1, 2)


def _band(tq: int, tk: int, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For queries at the last tq of tk positions: (keep [tq, tk], True where 0 <= query position -
    key position < window; that distance [tq, tk])."""
    distance = torch.arange(tk - tq, tk, device=device)[:, None] - torch.arange(tk, device=device)[None, :]
    return (distance >= 0) & (distance < window), distance


def sliding_window_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `sliding_window_attention_flex`, through SDPA with a dense mask."""
    tq, tk = q.shape[1], k.shape[1]
    keep, distance = _band(tq, tk, window, q.device)
    if key_padding_mask is not None:
        keep = keep & (key_padding_mask[:, None, None, :] | (distance == 0))  # [B, 1, Tq, Tk]
    if document_ids is not None:
        keep = keep & same_document(document_ids[:, tk - tq :], document_ids)[:, None]  # [B, 1, Tq, Tk]
    mask: torch.Tensor = keep
    work = q.dtype
    if alibi_slopes is not None:
        # An additive mask must have the query's dtype (module docstring): the bias is fp32, so
        # fp16/bf16 q, k, v go in as fp32 too.
        work = compute_dtype(q.dtype)
        bias = -alibi_slopes.to(work)[:, None, None] * distance.to(work)  # [H, Tq, Tk]
        # Every row keeps its own position (distance 0, own document), so no row is all -inf.
        mask = torch.where(keep, bias, float("-inf"))
    heads_first = [x.transpose(1, 2).to(work) for x in (q, k, v)]  # [B, H, T, d]
    out = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype)
