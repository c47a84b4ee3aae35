"""Packed rows in sliding-window attention: `document_ids` [B, Tk] keep every query to the keys of
its own document, on every backend.

The ground truth is the definition of packing itself: a packed row gives, for each document, the
outputs and gradients of that document run on its own (its slice of the row through the same
op). The paths that run on CPU are checked that way:

- "reference": the dense reference (backend="reference");
- "banded": the banded CPU kernels, which backend="auto" runs on CPU (a spy checks that);
- "blockwise": the blockwise O(T * W) path itself (on CPU the op hands it only key padding and
  trainable slopes, so it is called directly, inside the op's autocast handling);
- "sdpa": SDPA with a dense mask.

FlexAttention is CUDA-only through the op: its mask_mod is evaluated on CPU index grids against
the reference mask, and its forward runs eagerly (compile=False) on CPU.
"""

from __future__ import annotations

import pytest
import torch

from farsight.errors import InputError, InputTypeError
from farsight.ops import window as window_ops
from farsight.ops.precision import autocast_inputs
from farsight.ops.window import (
    flex_available,
    reference_mask,
    sliding_window_attention,
    sliding_window_attention_blockwise,
    sliding_window_attention_flex,
    window_mask_mod,
)
from tests.tolerance import RMS_RATIO, assert_close_rms

PATHS = ["reference", "banded", "blockwise", "sdpa"]
# the paths whose ALiBi slopes are differentiable (the banded kernels read them as numbers)
SLOPE_GRADS = {"reference", "blockwise", "sdpa"}


def attend(path, q, k, v, window, slopes=None, document_ids=None, block_size=None):
    """The op on one of the CPU paths."""
    if path == "blockwise":
        with autocast_inputs(q, k, v) as (q, k, v):
            return sliding_window_attention_blockwise(
                q, k, v, window, slopes, block_size=block_size, document_ids=document_ids
            )
    backend = {"reference": "reference", "banded": "auto", "sdpa": "sdpa"}[path]
    return sliding_window_attention(
        q, k, v, window, slopes, block_size=block_size, backend=backend, document_ids=document_ids
    )


def ids_of(layouts: list[list[int]]) -> torch.Tensor:
    """Document lengths per row -> document ids [B, T]: ids that start anywhere and skip values
    (only where they change matters)."""
    rows = []
    for row, lengths in enumerate(layouts):
        ids = 3 * torch.arange(len(lengths)) + 5 * row - 2
        rows.append(torch.repeat_interleave(ids, torch.tensor(lengths)))
    return torch.stack(rows)


def documents(lengths: list[int]):
    """(start, end) of each document of a row."""
    start = 0
    for length in lengths:
        yield start, start + length
        start += length


def qkv(b, tq, tk, h=3, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, tq, h, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(b, tk, h, d, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


# tq, tk, window, block_size, document lengths per row
CASES = [
    pytest.param(37, 37, 5, None, [[1, 10, 3, 23], [37]], id="T37-W5-one-token-docs"),
    pytest.param(
        37, 37, 5, 4, [[12, 25], [1, 1, 35], [6, 6, 6, 6, 6, 7], [1, 36]], id="T37-W5-block4-docs-longer-than-W"
    ),
    pytest.param(37, 37, 1, None, [[3, 34], [1] * 37], id="T37-W1"),
    pytest.param(37, 37, 64, None, [[5, 1, 1, 30], [20, 17]], id="T37-W-larger-than-T"),
    pytest.param(37, 37, 16, 4, [[2, 9, 26], [37], [30, 7]], id="T37-W16-block4-many-window-blocks"),
    pytest.param(12, 37, 6, None, [[10, 20, 7], [30, 2, 5]], id="decode-Tq12-Tk37"),
    pytest.param(1, 9, 9, None, [[4, 5], [8, 1]], id="decode-one-step"),
    pytest.param(4, 8, 5, 4, [[1, 7]], id="decode-only-the-windows-first-key-in-another-document"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("alibi", [False, True], ids=["no-alibi", "alibi"])
@pytest.mark.parametrize("tq,tk,window,block,layouts", CASES)
def test_packed_row_equals_each_document_alone(path, alibi, tq, tk, window, block, layouts):
    b, offset = len(layouts), tk - tq
    ids = ids_of(layouts)
    q, k, v = leaves(*qkv(b, tq, tk))
    slopes = torch.rand(3, dtype=torch.float64) + 0.1 if alibi else None
    trainable = alibi and path in SLOPE_GRADS
    if trainable:
        slopes.requires_grad_()
    inputs = [q, k, v] + ([slopes] if trainable else [])

    out = attend(path, q, k, v, window, slopes, ids, block)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, cotangent)

    want_out = torch.full_like(out, float("nan"))
    want = [torch.zeros_like(x) for x in inputs]  # keys of documents with no queries get no gradient
    for row, lengths in enumerate(layouts):
        for start, end in documents(lengths):
            first = max(start, offset)  # the document's first query position
            if first >= end:
                continue
            doc_q, doc_k, doc_v = leaves(
                q[row : row + 1, first - offset : end - offset],
                k[row : row + 1, start:end],
                v[row : row + 1, start:end],
            )
            doc_slopes = slopes.detach().clone().requires_grad_() if trainable else slopes
            doc_inputs = [doc_q, doc_k, doc_v] + ([doc_slopes] if trainable else [])
            doc_out = attend(path, doc_q, doc_k, doc_v, window, doc_slopes, block_size=block)
            doc_grads = torch.autograd.grad(
                doc_out, doc_inputs, cotangent[row : row + 1, first - offset : end - offset]
            )
            want_out[row : row + 1, first - offset : end - offset] = doc_out.detach()
            want[0][row : row + 1, first - offset : end - offset] = doc_grads[0]
            want[1][row : row + 1, start:end] = doc_grads[1]
            want[2][row : row + 1, start:end] = doc_grads[2]
            if trainable:
                want[3] += doc_grads[3]
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    for name, got, expected in zip(("dq", "dk", "dv", "dslopes"), grads, want):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tq,tk,window,block,layouts", [CASES[1], CASES[4], CASES[5]])
def test_changing_one_document_leaves_the_others_bit_for_bit(path, tq, tk, window, block, layouts):
    b, offset = len(layouts), tk - tq
    ids = ids_of(layouts)
    q, k, v = qkv(b, tq, tk, dtype=torch.float32)
    slopes = torch.rand(3) + 0.1
    base = attend(path, q, k, v, window, slopes, ids, block)
    for row, lengths in enumerate(layouts):
        for start, end in documents(lengths):
            changed = [x.clone() for x in (q, k, v)]
            changed[0][row, max(start - offset, 0) : max(end - offset, 0)] += 3 * torch.randn(3, 8)
            changed[1][row, start:end] += 3 * torch.randn(3, 8)
            changed[2][row, start:end] += 3 * torch.randn(3, 8)
            out = attend(path, *changed, window, slopes, ids, block)
            inside = torch.zeros(b, tq, dtype=torch.bool)
            inside[row, max(start - offset, 0) : max(end - offset, 0)] = True
            assert torch.equal(out[~inside], base[~inside]), f"row {row}, document [{start}, {end})"
            if inside.any():
                assert not torch.equal(out[inside], base[inside])  # the change did reach its own document


@pytest.mark.parametrize("path", PATHS)
def test_bf16_autocast_matches_the_fp64_reference(path):
    layouts = [[1, 30, 3, 30], [64], [40, 24]]
    tq = tk = 64
    window = 24
    ids = ids_of(layouts)
    exact = [*qkv(len(layouts), tq, tk, h=4, d=16), torch.rand(4, dtype=torch.float64) + 0.1]
    trainable = path in SLOPE_GRADS
    cotangent = torch.randn(len(layouts), tq, 4, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(inputs, fn):
        inputs = leaves(*inputs[:3]) + (leaves(inputs[3]) if trainable else [inputs[3]])
        out = fn(*inputs)
        (out.double() * cotangent).sum().backward()
        return out.detach(), [x.grad for x in inputs if x.requires_grad]

    want_out, want_grads = run(
        exact, lambda q, k, v, s: sliding_window_attention(q, k, v, window, s, backend="reference", document_ids=ids)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_out, got_grads = run(
            [x.float() for x in exact], lambda q, k, v, s: attend(path, q, k, v, window, s, ids, block_size=16)
        )
    assert got_out.dtype == torch.bfloat16
    assert_close_rms("o", want_out, got_out, RMS_RATIO[torch.bfloat16])
    assert len(got_grads) == len(want_grads) == (4 if trainable else 3)
    for name, want, got in zip(("dq", "dk", "dv", "dslopes"), want_grads, got_grads):
        assert got.dtype == torch.float32, name
        assert_close_rms(name, want, got, RMS_RATIO[torch.bfloat16])


@pytest.mark.parametrize("backend", ["reference", "auto", "sdpa"])
@pytest.mark.parametrize("trainable", [False, True], ids=["fixed-slopes", "trainable-slopes"])
@pytest.mark.parametrize("layouts", [[[37]], [[37], [37]]], ids=["one-row", "two-rows"])
def test_one_document_per_row_runs_exactly_as_without_ids(backend, trainable, layouts):
    # ("auto" on CPU: the banded kernels with fixed slopes, the blockwise path with trainable ones)
    q, k, v = leaves(*qkv(len(layouts), 37, 37, dtype=torch.float32))
    slopes = torch.rand(3, requires_grad=trainable)
    without = sliding_window_attention(q, k, v, 5, slopes, backend=backend)
    with_ids = sliding_window_attention(q, k, v, 5, slopes, backend=backend, document_ids=ids_of(layouts))
    assert torch.equal(with_ids, without)
    grad = torch.randn_like(without)
    inputs = (q, k, v, slopes) if trainable else (q, k, v)
    for got, want in zip(torch.autograd.grad(with_ids, inputs, grad), torch.autograd.grad(without, inputs, grad)):
        assert torch.equal(got, want)


def test_auto_runs_the_banded_kernels_on_cpu_with_documents(monkeypatch):
    from farsight.ops.window import banded

    built = []
    original = banded._document_addend

    def spy(*args):
        built.append(original(*args))
        return built[-1]

    def fail(*args, **kwargs):
        raise AssertionError("auto left the banded kernels on CPU")

    monkeypatch.setattr(banded, "_document_addend", spy)
    for name in (
        "sliding_window_attention_blockwise",
        "sliding_window_attention_sdpa",
        "sliding_window_attention_flex",
    ):
        monkeypatch.setattr(window_ops, name, fail)
    q, k, v = qkv(1, 200, 200, dtype=torch.float32)
    ids = ids_of([[70, 130]])
    out = sliding_window_attention(q, k, v, 16, document_ids=ids)
    assert len(built) == 1 and bool(built[0].isinf().any())
    want = sliding_window_attention(q, k, v, 16, backend="reference", document_ids=ids)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_memory_stays_linear_in_length_with_documents():
    # what the banded kernels save for the backward is the [block, span] tiles, never [T, T]
    q, k, v = leaves(*qkv(1, 512, 512, h=1, dtype=torch.float32))
    ids = ids_of([[100] * 5 + [12]])
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sliding_window_attention(q, k, v, 16, document_ids=ids)
    assert max(sizes) < 512 * 512 / 4


# --- the masks themselves ---------------------------------------------------------------------


def mask_by_definition(tq, tk, window, key_padding_mask, document_ids):
    """[B, 1, Tq, Tk], written out one (query, key) pair at a time."""
    b = document_ids.shape[0]
    mask = torch.zeros(b, 1, tq, tk, dtype=torch.bool)
    for row in range(b):
        for i in range(tq):
            p = tk - tq + i
            for j in range(tk):
                padded = key_padding_mask is not None and not key_padding_mask[row, j] and j != p
                same = bool(document_ids[row, p] == document_ids[row, j])
                mask[row, 0, i, j] = 0 <= p - j < window and not padded and same
    return mask


MASK_CASES = [(37, 37, 5), (12, 37, 6), (1, 37, 40), (37, 37, 1)]
MASK_LAYOUTS = [[1, 10, 3, 23], [37], [30, 2, 5]]


@pytest.mark.parametrize("tq,tk,window", MASK_CASES)
@pytest.mark.parametrize("padding", [False, True])
def test_reference_mask_follows_the_definition(tq, tk, window, padding):
    ids = ids_of(MASK_LAYOUTS)
    key_padding_mask = torch.rand(ids.shape) > 0.3 if padding else None
    got = reference_mask(tq, tk, window, key_padding_mask, ids)
    assert torch.equal(
        got.expand(len(MASK_LAYOUTS), 1, tq, tk), mask_by_definition(tq, tk, window, key_padding_mask, ids)
    )


@pytest.mark.parametrize("tq,tk,window", MASK_CASES)
@pytest.mark.parametrize("padding", [False, True])
def test_flex_mask_mod_on_index_grids_equals_the_reference_mask(tq, tk, window, padding):
    ids = ids_of(MASK_LAYOUTS)
    b = ids.shape[0]
    key_padding_mask = torch.rand(ids.shape) > 0.3 if padding else None
    mask_mod = window_mask_mod(window, tk - tq, key_padding_mask, ids)
    grid = mask_mod(
        torch.arange(b)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(tq)[None, None, :, None],
        torch.arange(tk)[None, None, None, :],
    )
    want = reference_mask(tq, tk, window, key_padding_mask, ids).expand(b, 1, tq, tk)
    assert torch.equal(grid.expand(b, 1, tq, tk), want)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("alibi", [False, True], ids=["no-alibi", "alibi"])
@pytest.mark.parametrize("padding", [False, True])
def test_flex_forward_with_documents_matches_reference_eagerly(alibi, padding):
    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    ids = ids_of([[10, 20, 7], [30, 2, 5]])
    q, k, v = qkv(2, 12, 37, h=2, d=4, dtype=torch.float32)
    slopes = torch.rand(2) if alibi else None
    key_padding_mask = torch.rand(ids.shape) > 0.3 if padding else None
    got = sliding_window_attention_flex(q, k, v, 6, slopes, None, key_padding_mask, compile=False, document_ids=ids)
    want = sliding_window_attention(
        q, k, v, 6, slopes, key_padding_mask=key_padding_mask, backend="reference", document_ids=ids
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["reference", "blockwise", "sdpa"])
def test_documents_with_key_padding_match_reference(path):
    # blockwise and SDPA combine both masks (the banded kernels take no key padding)
    ids = ids_of([[10, 20, 7], [30, 2, 5]])
    q, k, v = leaves(*qkv(2, 12, 37))
    key_padding_mask = torch.rand(ids.shape) > 0.4
    slopes = torch.rand(3, dtype=torch.float64)
    backend = {"reference": "reference", "blockwise": "blockwise", "sdpa": "sdpa"}[path]
    out = sliding_window_attention(
        q, k, v, 6, slopes, key_padding_mask=key_padding_mask, block_size=4, backend=backend, document_ids=ids
    )
    want = mask_by_definition(12, 37, 6, key_padding_mask, ids)
    # the definition, query by query: softmax over the visible keys only
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    distance = torch.arange(25, 37)[:, None] - torch.arange(37)[None, :]
    scores = (scores - slopes[:, None, None] * distance).masked_fill(~want, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "document_ids,error,message",
    [
        (torch.zeros(2, 8, dtype=torch.long), InputError, r"document_ids must have shape \[2, 9\] \(batch, tokens\)"),
        (torch.zeros(2, 9, 1, dtype=torch.long), InputError, r"document_ids must have shape \[2, 9\]"),
        (torch.zeros(2, 9), InputTypeError, "document_ids must be an integer tensor"),
        (torch.zeros(2, 9, dtype=torch.bool), InputTypeError, "document_ids must be an integer tensor"),
        ([[0] * 9] * 2, InputTypeError, "document_ids must be a torch.Tensor"),
        (torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2, 2], [0] * 9]), InputError, "document_ids decrease inside a row"),
        (torch.zeros(2, 9, dtype=torch.long, device="meta"), InputError, "document_ids is on meta but q is on cpu"),
    ],
    ids=["length", "ndim", "float", "bool", "list", "decreasing", "device"],
)
def test_bad_document_ids_are_one_line_errors(document_ids, error, message):
    q, k, v = qkv(2, 4, 9, dtype=torch.float32)
    for backend in ("auto", "reference"):
        with pytest.raises(error, match=message) as raised:
            sliding_window_attention(q, k, v, 3, backend=backend, document_ids=document_ids)
        assert "\n" not in str(raised.value)
