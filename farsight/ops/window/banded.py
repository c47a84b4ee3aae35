"""Causal sliding-window attention for the CPU in the inputs' dtype: two custom ops (forward,
backward) made of ATen's batched GEMMs and its fused softmax kernels.

Queries are cut into blocks of `block` rows; query block i reads the `nwin + 1` key blocks that
end with its own (nwin = ceil((W - 1) / block)), so its key window has `span = (nwin + 1) * block`
columns, and the window gradients fold back onto the keys as nwin + 1 shifted block sums. Per
head the scores of every block come out of one `baddbmm` whose addend is the band (-inf outside
it) and the ALiBi bias, so the mask and the bias cost no pass of their own:

    forward:  S = bias + (scale q) K_w^T;  P = softmax(S);  O = P V_w
    backward: dP = dO V_w^T;  dS = P * (dP - rowsum(P * dP));  dq = scale dS K_w,
              dK_w = dS^T (scale q),  dV_w = P^T dO

Packed rows (document_ids [B, Tk], `farsight.ops.documents`): the keys of other documents get
-inf too. Per call, one [B * n_blocks, block, span] tile of 0 / -inf (each block's row ids
against its key window's ids, shared by the heads) is added to the band-and-ALiBi addend where
each head's scores are initialised: that sum replaces the unmasked path's copy of the addend
into the scores, and is then accumulated into by the GEMM (baddbmm_ in place). The GEMMs, the
softmax and the whole backward are those of the unmasked path: the saved probabilities are 0 on
hidden keys, so every gradient product ignores them.

Every product takes the inputs' dtype (bf16/fp16 products accumulate in fp32 inside the GEMM and
round their result once); the softmax and its backward are ATen's fused kernels, which keep the
row max, the sums and the exponentials in fp32 and write bf16/fp16 probabilities directly. So a
bf16 call makes no fp32 copy of its [blocks, block, span] tiles: the scores, the probabilities
(saved for the backward) and dS are bf16. The addend is rounded to the inputs' dtype (for ALiBi
the same rounding as the scores'; -inf stays -inf). Key-window gradients are folded in fp32.

Where the CPU has no matrix instructions for the dtype (bf16 on AVX2, fp16 without AVX512-FP16)
the products run as fp32 GEMMs rounded back (as `farsight.ops.precision.widened_matmuls` does),
since a dispatch mode does not see inside a custom op.

Custom ops (torch.library) are opaque to torch.compile: a compiled model keeps these kernels
(inductor's own softmax ran about 2x slower) and fuses what surrounds them.
"""

from __future__ import annotations

import functools

import torch

from farsight.ops.checks import compute_dtype
from farsight.ops.library import custom_op
from farsight.ops.precision import software_matmul_dtypes
from farsight.ops.window.blockwise import pad_document_ids

# Tuned on a 2-core AMX Xeon (W = 512, d = 64, bf16 f+b): 128-row blocks cut the band's unused
# corners (span 640 for 512 keys) while the GEMMs stay large.
BANDED_BLOCK = 128
# Smaller windows take smaller blocks so that the span stays within ~1.5x of the window.
MIN_BLOCK = 32


def banded_block_size(window: int, queries: int) -> int:
    """Rows per query block for a window of `window` keys: the largest power of two <= BANDED_BLOCK
    whose span (nwin + 1) * block wastes at most half the window, clipped to the queries."""
    block = BANDED_BLOCK
    while block > MIN_BLOCK and (_nwin(window, block) + 1) * block > 1.5 * window + block:
        block //= 2
    return max(1, min(block, queries))


def _nwin(window: int, block: int) -> int:
    return -(-(window - 1) // block)


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: fp32 where the CPU multiplies x's dtype in software."""
    return torch.float32 if x.dtype in software_matmul_dtypes(x.device) else x.dtype


def _bmm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == a.dtype:
        return torch.bmm(a, b)
    return torch.bmm(a.to(dtype), b.to(dtype)).to(a.dtype)


@functools.lru_cache(maxsize=32)
def _addend(
    slopes: tuple[float, ...] | None, heads: int, block: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[heads, block, span]: -inf outside the band, minus slope * distance inside it (0 without
    ALiBi), in `dtype`. Row r of a block sits at distance r + nwin * block - c from column c."""
    nwin = _nwin(window, block)
    rows = torch.arange(block, device=device)[:, None]
    cols = torch.arange((nwin + 1) * block, device=device)[None, :]
    distance = rows + nwin * block - cols
    work = compute_dtype(dtype)
    addend = torch.zeros(distance.shape, dtype=work, device=device)
    addend = addend.masked_fill((distance < 0) | (distance >= window), float("-inf")).expand(heads, -1, -1)
    if slopes is not None:
        addend = addend - torch.tensor(slopes, dtype=work, device=device).view(heads, 1, 1) * distance.to(work)
    return addend.to(dtype).contiguous()


class _Geometry:
    """Where the blocks and key windows of one call sit (queries are the last tq of tk keys)."""

    def __init__(self, tq: int, tk: int, window: int, block: int) -> None:
        self.tq, self.tk, self.window, self.block = tq, tk, window, block
        self.nwin = _nwin(window, block)
        self.span = (self.nwin + 1) * block
        self.n_blocks = -(-tq // block)
        self.offset = tk - tq
        self.pad_left = max(0, self.nwin * block - self.offset)
        self.pad_right = self.n_blocks * block - tq
        self.start = self.pad_left + self.offset - self.nwin * block
        # blocks whose window reaches keys before position 0 (padding, to be masked)
        self.padded_blocks = min(self.n_blocks, -(-self.pad_left // block)) if self.pad_left else 0
        # Without cached keys (training) every window starts nwin blocks before its own block,
        # and the first nwin blocks of a sequence see only masked padding there: the windows of
        # consecutive sequences (and heads) can be folded as one flat run of blocks.
        self.flat = self.offset == 0

    def _heads_first(self, x: torch.Tensor, left: int) -> torch.Tensor:
        """[B, T, H, d] -> [H, B, left + T + pad_right, d], zeros in the pads (one copy)."""
        batch, steps, heads, dim = x.shape
        out = x.new_empty(heads, batch, left + steps + self.pad_right, dim)
        if left:
            out[:, :, :left].zero_()
        if self.pad_right:
            out[:, :, left + steps :].zero_()
        out[:, :, left : left + steps].copy_(x.permute(2, 0, 1, 3))
        return out

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tq, H, d] -> [H, B * n_blocks, block, d]."""
        heads, dim = x.shape[2], x.shape[3]
        return self._heads_first(x, 0).view(heads, -1, self.block, dim)

    def windows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tk, H, d] -> key windows [H, B * n_blocks, span, d] (contiguous)."""
        heads, dim = x.shape[2], x.shape[3]
        padded = self._heads_first(x, self.pad_left)[:, :, self.start :]
        windows = padded.unfold(2, self.span, self.block)[:, :, : self.n_blocks].transpose(-1, -2)
        return windows.reshape(heads, -1, self.span, dim).contiguous()

    def rows(self, x: torch.Tensor, batch: int, scale: float = 1.0) -> torch.Tensor:
        """scale * x [H, B * n_blocks, block, d] -> [B, Tq, H, d] (contiguous, one pass)."""
        heads, dim = x.shape[0], x.shape[-1]
        rows = x.view(heads, batch, self.n_blocks * self.block, dim)[:, :, : self.tq].permute(1, 2, 0, 3)
        out = x.new_empty(batch, self.tq, heads, dim)
        return out.copy_(rows) if scale == 1.0 else torch.mul(rows, scale, out=out)

    def fold(self, windows: torch.Tensor, batch: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """Key-window gradients [H, B * n_blocks, span, d] -> scale * their sum per key, [B, Tk, H,
        d] in `dtype` (contiguous), summed in the compute dtype."""
        heads, dim, nb, block = windows.shape[0], windows.shape[-1], self.n_blocks, self.block
        parts = windows.view(heads, batch, nb, self.nwin + 1, block, dim)
        total = windows.new_empty(
            heads, batch, self.pad_left + self.tk + self.pad_right, dim, dtype=compute_dtype(windows.dtype)
        )
        total[:, :, : self.start].zero_()  # keys no query block reaches
        # window j of block i covers the padded positions start + (i + j) * block ...
        covered = total[:, :, self.start :].view(heads, batch, nb + self.nwin, block, dim)
        covered[:, :, :nb].copy_(parts[:, :, :, 0])
        covered[:, :, nb:].zero_()
        for j in range(1, self.nwin + 1):
            covered[:, :, j : j + nb].add_(parts[:, :, :, j])  # add_, not +=: no write-back copy
        keys = total[:, :, self.pad_left : self.pad_left + self.tk].permute(1, 2, 0, 3)
        out = torch.empty(keys.shape, dtype=dtype, device=keys.device)
        return out.copy_(keys) if scale == 1.0 else torch.mul(keys, scale, out=out)


def _fold_product(
    a: torch.Tensor,
    b: torch.Tensor,
    geo: _Geometry,
    batch: int,
    heads: int,
    dtype: torch.dtype,
    gemm: torch.dtype,
    scale: float = 1.0,
) -> torch.Tensor:
    """Key-window gradients a @ b ([G, span, block] @ [G, block, d], G = H * B * n_blocks) folded
    onto the keys: scale * their sum per key, [B, Tk, H, d] in `dtype`.

    In the flat case the products are written into a buffer with nwin zero blocks after the
    last, and key block g sums part nwin - t of query block g + t (t = 0..nwin) through one
    strided view: a single reduction pass (accumulating in the compute dtype, rounded to the
    inputs' dtype once) instead of nwin + 1 converting adds. Parts that cross into the next sequence (or head) are those of its first blocks'
    masked padding, exactly zero."""
    g, dim = a.shape[0], b.shape[-1]
    if not geo.flat:
        return geo.fold(_bmm(a, b, gemm).view(heads, -1, geo.span, dim), batch, dtype, scale)
    buffer = a.new_empty(g + geo.nwin, geo.span, dim)
    buffer[g:].zero_()
    if gemm == a.dtype:
        torch.bmm(a, b, out=buffer[:g])
    else:
        buffer[:g] = _bmm(a, b, gemm)
    per_block, per_part = geo.span * dim, geo.block * dim
    view = buffer.as_strided(
        (g, geo.nwin + 1, geo.block, dim), (per_block, per_block - per_part, dim, 1), geo.nwin * per_part
    )
    summed = view.sum(dim=1)  # accumulated in the compute dtype, rounded once
    keys = summed.view(heads, batch, geo.n_blocks * geo.block, dim)[:, :, : geo.tk].permute(1, 2, 0, 3)
    out = torch.empty(keys.shape, dtype=dtype, device=keys.device)
    return out.copy_(keys) if scale == 1.0 else torch.mul(keys, scale, out=out)


def _document_addend(document_ids: torch.Tensor, geo: _Geometry, dtype: torch.dtype) -> torch.Tensor:
    """document_ids [B, Tk] -> [B * n_blocks, block, span] in `dtype`: -inf where a block's row and
    a key of its window lie in different documents, 0 elsewhere. Padded rows and keys extend the
    first and last documents (the band and the masking of keys before 0 hide the padded keys)."""
    batch = document_ids.shape[0]
    keys = pad_document_ids(document_ids, geo.pad_left, geo.pad_right)[:, geo.start :]
    key_ids = keys.unfold(1, geo.span, geo.block)[:, : geo.n_blocks]  # [B, n_blocks, span]
    query_ids = pad_document_ids(document_ids[:, geo.offset :], 0, geo.pad_right).view(batch, geo.n_blocks, geo.block)
    other = query_ids[..., :, None] != key_ids[..., None, :]  # [B, n_blocks, block, span]
    addend = torch.zeros(other.shape, dtype=dtype, device=document_ids.device).masked_fill_(other, float("-inf"))
    return addend.view(-1, geo.block, geo.span)


def _scores(
    qb: torch.Tensor,
    kw: torch.Tensor,
    addend: torch.Tensor,
    scale: float,
    geo: _Geometry,
    batch: int,
    gemm: torch.dtype,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """addend (+ documents) + scale * qb kw^T per head: [H, B * n_blocks, block, span], keys before
    0 masked. `documents` is `_document_addend`'s tile, the same for every head."""
    heads = qb.shape[0]
    scores = qb.new_empty(heads, qb.shape[1], geo.block, geo.span)
    for h in range(heads):
        if documents is None:
            bias = addend[h].expand(qb.shape[1], -1, -1)
            if gemm == qb.dtype:
                torch.baddbmm(bias, qb[h], kw[h].transpose(1, 2), alpha=scale, out=scores[h])
            else:
                scores[h] = torch.baddbmm(bias.to(gemm), qb[h].to(gemm), kw[h].transpose(1, 2).to(gemm), alpha=scale)
        elif gemm == qb.dtype:
            # the sum takes the place of the addend's copy into the output (one pass either way)
            torch.add(documents, addend[h], out=scores[h])
            scores[h].baddbmm_(qb[h], kw[h].transpose(1, 2), alpha=scale)
        else:
            bias = (documents + addend[h]).to(gemm)
            scores[h] = torch.baddbmm(bias, qb[h].to(gemm), kw[h].transpose(1, 2).to(gemm), alpha=scale)
    if geo.padded_blocks:
        cols = torch.arange(geo.span, device=qb.device)
        first = geo.offset - geo.nwin * geo.block + torch.arange(geo.padded_blocks, device=qb.device) * geo.block
        before = (first[:, None] + cols[None, :]) < 0  # [padded_blocks, span]
        view = scores.view(heads, batch, geo.n_blocks, geo.block, geo.span)[:, :, : geo.padded_blocks]
        view.masked_fill_(before[:, None, :], float("-inf"))
    return scores


@custom_op("banded_attention")
def banded_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None,
    window: int,
    block: int,
    scale: float,
    document_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Tq, H, d], k/v [B, Tk, H, d], document_ids [B, Tk] long or None -> (o [B, Tq, H, d],
    probabilities [H, B * n_blocks, block, span] for the backward), all in q's dtype."""
    batch, tq, heads, dim = q.shape
    geo = _Geometry(tq, k.shape[1], window, block)
    gemm = _gemm_dtype(q)
    values = None if slopes is None else tuple(float(s) for s in slopes.tolist())
    addend = _addend(values, heads, block, window, q.dtype, q.device)
    documents = None if document_ids is None else _document_addend(document_ids, geo, q.dtype)
    scores = _scores(geo.queries(q), geo.windows(k), addend, scale, geo, batch, gemm, documents)
    del documents
    probs = torch.softmax(scores.view(-1, geo.block, geo.span), dim=-1)
    del scores
    out = _bmm(probs, geo.windows(v).view(-1, geo.span, dim), gemm)
    return geo.rows(out.view(heads, -1, geo.block, dim), batch), probs


@banded_attention_forward.register_fake
def _(q, k, v, slopes, window, block, scale, document_ids):
    batch, tq, heads, _ = q.shape
    geo = _Geometry(tq, k.shape[1], window, block)
    return q.new_empty(q.shape), q.new_empty(heads * batch * geo.n_blocks, block, geo.span)


@custom_op("banded_attention_backward")
def banded_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probs: torch.Tensor,
    window: int,
    block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `banded_attention_forward` with respect to q, k and v."""
    batch, tq, heads, dim = q.shape
    geo = _Geometry(tq, k.shape[1], window, block)
    gemm = _gemm_dtype(q)
    go = geo.queries(grad_out.to(q.dtype)).view(-1, block, dim)
    kw, vw = geo.windows(k).view(-1, geo.span, dim), geo.windows(v).view(-1, geo.span, dim)
    grad_probs = _bmm(go, vw.transpose(1, 2), gemm)
    del vw
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    del grad_probs
    dq = _bmm(grad_scores, kw, gemm)
    del kw
    dq = geo.rows(dq.view(heads, -1, block, dim), batch, scale)
    qb = geo.queries(q).view(-1, block, dim)
    dk = _fold_product(grad_scores.transpose(1, 2), qb, geo, batch, heads, k.dtype, gemm, scale)
    del grad_scores, qb
    dv = _fold_product(probs.transpose(1, 2), go, geo, batch, heads, v.dtype, gemm)
    return dq, dk, dv


@banded_attention_backward.register_fake
def _(grad_out, q, k, v, probs, window, block, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, _, window, block, scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.geometry = (window, block, scale)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_probs):
    q, k, v, probs = ctx.saved_tensors
    dq, dk, dv = banded_attention_backward(grad_out, q, k, v, probs, *ctx.geometry)
    return dq, dk, dv, None, None, None, None, None


banded_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def sliding_window_attention_banded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Tq, H, d], k/v [B, Tk, H, d] (Tk >= Tq; queries are the last Tq positions) ->
    [B, Tq, H, d] in q's dtype, the semantics of `sliding_window_attention_reference` without key
    padding; document_ids [B, Tk] (integer, non-decreasing along a row) keeps each query to its
    own document's keys. Inputs assumed valid (`farsight.ops.window.sliding_window_attention`
    checks them); differentiable in q, k and v (not in the slopes, which are read as numbers)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    block = min(block_size, q.shape[1]) if block_size else banded_block_size(window, q.shape[1])
    if document_ids is not None:
        document_ids = document_ids.long()
    return banded_attention_forward(q, k, v, alibi_slopes, window, block, scale, document_ids)[0]
