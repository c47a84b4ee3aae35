"""CASTLE on packed rows (`document_ids`): every backend gives each document of a row the
outputs and gradients of that document run on its own, changing one document leaves the others'
results bit for bit (torch path), one document per row runs exactly as without ids, and bad ids
are one-line errors.

The Triton kernels run natively on CUDA, else under the CPU interpreter (TRITON_INTERPRET is set
before farsight.ops.castle.triton is first imported, as in tests/ops/test_castle_triton.py): in
fp32 there (the interpreter computes bf16 tl.dot wrongly) and on tiny shapes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import farsight.ops.castle as castle_ops  # noqa: E402
from farsight.errors import InputError, InputTypeError  # noqa: E402
from farsight.ops.castle import castle_attention, castle_parallel_reference, castle_recurrent  # noqa: E402
from tests.tolerance import RMS_RATIO, assert_close_rms  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
NAMES = ("o", "dqu", "dku", "dvu", "dqc", "dkc", "dvc")
NEEDS_TRITON = [pytest.mark.triton, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")]
# Document lengths per row of the packed batch (T = 37): a one-token document, documents longer
# than every block below (torch 8, Triton 16), boundaries inside and on block edges, and rows of
# different layouts (none of them one document: the torch path skips rows up to the latest end
# of a key block's documents over the batch, which such a row would push to T).
LAYOUTS = [[10, 1, 20, 6], [1, 16, 20], [5, 32]]


def document_ids(layouts: list[list[int]], first: int = 0) -> torch.Tensor:
    """[B, T] ids from document lengths per row; ids are arbitrary non-decreasing values."""
    rows = [
        torch.cat([torch.full((n,), first + 3 * k + 7 * b) for k, n in enumerate(row)]) for b, row in enumerate(layouts)
    ]
    return torch.stack(rows).to(DEVICE)


def documents(layouts: list[list[int]]):
    """(row, start, stop) of every document."""
    for b, row in enumerate(layouts):
        start = 0
        for n in row:
            yield b, start, start + n
            start += n


def make_inputs(batch, steps, heads=2, dim=5, dtype=torch.float64, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, steps, heads, dim, generator=gen, dtype=torch.float64).to(DEVICE, dtype) for _ in range(6)
    ]


def outputs_and_grads(fn, inputs, cotangent, **kwargs) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, cotangent)]


def triton_op():
    from farsight.ops.castle.triton import castle_attention_triton

    return castle_attention_triton


# backend -> (op, keyword arguments, dtype, (atol, rtol)); each is called on the packed row and on
# every document alone with the same arguments (minus the ids).
FP64 = (1e-10, 1e-10)
FP32 = (2e-5, 1e-4)
BACKENDS = {
    "torch": (castle_attention, dict(backend="torch", block_size=8), torch.float64, FP64),
    "torch-sub-blocks": (castle_attention, dict(backend="torch", block_size=16), torch.float64, FP64),
    "torch-default-block": (castle_attention, dict(backend="torch"), torch.float64, FP64),
    "reference": (castle_attention, dict(backend="reference"), torch.float64, FP64),
    "recurrent": (castle_recurrent, {}, torch.float64, FP64),
    "triton": ("triton", dict(block=16), torch.float32, FP32),
    # the backward's tile smaller than the forward's, one query block per forward group
    "triton-tiles": ("triton", dict(block=32, backward_block=16, group=1), torch.float32, FP32),
    # the backward in two passes (farsight.ops.castle.triton.BACKWARD = "passes")
    "triton-passes": ("triton", dict(block=16), torch.float32, FP32),
}
# (backend, window): every backend with and without a window; the tile variant once (the
# interpreter is slow).
CASES = [(name, window) for name in BACKENDS if name != "triton-tiles" for window in (None, 3)]
CASES += [("triton-tiles", None)]
CASE_PARAMS = [pytest.param(*case, marks=NEEDS_TRITON) if "triton" in case[0] else case for case in CASES]


def backend_op(name: str, monkeypatch):
    op, kwargs, dtype, tolerance = BACKENDS[name]
    if op == "triton":
        op = triton_op()
        if name == "triton-passes":
            import farsight.ops.castle.triton as castle_triton

            monkeypatch.setattr(castle_triton, "BACKWARD", "passes")
    return op, kwargs, dtype, tolerance


@pytest.mark.parametrize("backend,window", CASE_PARAMS)
def test_packed_row_equals_each_document_alone(backend, window, monkeypatch) -> None:
    op, kwargs, dtype, (atol, rtol) = backend_op(backend, monkeypatch)
    ids = document_ids(LAYOUTS)
    inputs = make_inputs(len(LAYOUTS), ids.shape[1], dtype=dtype)
    cotangent = make_inputs(len(LAYOUTS), ids.shape[1], dtype=dtype, seed=1)[0]
    packed = outputs_and_grads(op, inputs, cotangent, window=window, document_ids=ids, **kwargs)
    for b, start, stop in documents(LAYOUTS):
        part = slice(start, stop)
        alone = outputs_and_grads(
            op, [x[b : b + 1, part] for x in inputs], cotangent[b : b + 1, part], window=window, **kwargs
        )
        where = f"row {b} [{start}:{stop}]"
        for name, got, want in zip(NAMES, packed, alone):
            assert got.dtype == dtype, name
            torch.testing.assert_close(
                got[b : b + 1, part], want, atol=atol, rtol=rtol, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}"
            )


@pytest.mark.parametrize("window", [None, 1, 3])
def test_recurrent_definition_equals_masking_the_score_alone(window) -> None:
    # The recurrent form keeps U^t[s] inside s's document explicitly; the parallel form masks only
    # the [query, key] score. They agree because documents are contiguous.
    ids = document_ids(LAYOUTS)
    inputs = make_inputs(len(LAYOUTS), ids.shape[1], heads=1, dim=4, seed=2)
    cotangent = make_inputs(len(LAYOUTS), ids.shape[1], heads=1, dim=4, seed=3)[0]
    got = outputs_and_grads(castle_recurrent, inputs, cotangent, window=window, document_ids=ids)
    want = outputs_and_grads(castle_parallel_reference, inputs, cotangent, window=window, document_ids=ids)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("backend", ["torch", "reference", pytest.param("triton", marks=NEEDS_TRITON)])
def test_one_token_documents_attend_to_themselves(backend, window) -> None:
    # Every token its own document: no lookahead token and one key, so o = vc (through the dispatch).
    dtype = torch.float32 if backend == "triton" else torch.float64
    ids = torch.arange(21, device=DEVICE).expand(2, -1)
    inputs = make_inputs(2, 21, dtype=dtype)
    out = castle_attention(*inputs, window=window, document_ids=ids, backend=backend, block_size=8)
    torch.testing.assert_close(out, inputs[5], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_changing_one_document_leaves_the_others_bit_for_bit(block_size, window) -> None:
    ids = document_ids(LAYOUTS)
    inputs = make_inputs(len(LAYOUTS), ids.shape[1])
    cotangent = make_inputs(len(LAYOUTS), ids.shape[1], seed=1)[0]
    kwargs = dict(window=window, document_ids=ids, block_size=block_size, backend="torch")
    base = outputs_and_grads(castle_attention, inputs, cotangent, **kwargs)
    for b, start, stop in documents(LAYOUTS):
        changed = [x.clone() for x in inputs]
        for x in changed:
            x[b, start:stop] = torch.randn_like(x[b, start:stop])
        got = outputs_and_grads(castle_attention, changed, cotangent, **kwargs)
        inside = torch.zeros(ids.shape, dtype=torch.bool, device=DEVICE)
        inside[b, start:stop] = True
        for name, g, w in zip(NAMES, got, base):
            assert torch.equal(g[~inside], w[~inside]), (
                f"{name}: changing row {b} [{start}:{stop}] changed another document"
            )
        assert not torch.equal(got[0][inside], base[0][inside])


@pytest.mark.parametrize("backend", ["torch", "reference", pytest.param("triton", marks=NEEDS_TRITON)])
def test_one_document_per_row_runs_as_without_ids(backend, monkeypatch) -> None:
    # Bit for bit, because the backends are not even handed the ids: the path without documents runs.
    handed: list[object] = []

    def spy(module, name):
        function = getattr(module, name)

        def run(*args, **kwargs):
            handed.append(kwargs["document_ids"] if "document_ids" in kwargs else args[-1])
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    spy(castle_ops.blockwise, "castle_attention")
    spy(castle_ops.reference, "castle_parallel_reference")
    spy(castle_ops, "castle_attention_triton")
    dtype = torch.float32 if backend == "triton" else torch.float64
    inputs = make_inputs(2, 19, dtype=dtype)
    cotangent = make_inputs(2, 19, dtype=dtype, seed=1)[0]
    ids = torch.tensor([[4] * 19, [9] * 19], device=DEVICE)
    for window in (None, 3) if backend != "triton" else (3,):
        kwargs = dict(window=window, backend=backend, block_size=8)
        got = outputs_and_grads(castle_attention, inputs, cotangent, document_ids=ids, **kwargs)
        want = outputs_and_grads(castle_attention, inputs, cotangent, **kwargs)
        for name, g, w in zip(NAMES, got, want):
            assert torch.equal(g, w), name
    assert handed and all(x is None for x in handed)


def test_empty_rows() -> None:
    inputs = [x.requires_grad_(True) for x in make_inputs(2, 0, heads=3, dim=4)]
    out = castle_attention(*inputs, document_ids=torch.zeros(2, 0, dtype=torch.long, device=DEVICE), backend="torch")
    assert out.shape == (2, 0, 3, 4)
    out.sum().backward()
    assert inputs[0].grad.shape == inputs[0].shape


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_autocast_matches_the_fp64_reference(window) -> None:
    # CPU autocast, as the CPU trainer runs it; a row of one document beside packed ones.
    ids = document_ids([[30, 1, 40, 25], [96], [3, 90, 3]]).cpu()
    exact = [x.cpu() for x in make_inputs(3, ids.shape[1], heads=2, dim=16, seed=4)]
    cotangent = make_inputs(3, ids.shape[1], heads=2, dim=16, seed=5)[0].cpu()
    want = outputs_and_grads(castle_parallel_reference, exact, cotangent, window=window, document_ids=ids)
    inputs = [x.float() for x in exact]
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = castle_attention(*leaves, window=window, document_ids=ids, block_size=16, backend="torch")
        grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype))
    assert out.dtype == torch.bfloat16
    for name, g, w in zip(NAMES, [out, *grads], want):
        assert name == "o" or g.dtype == torch.float32, name
        assert_close_rms(name, w, g, RMS_RATIO[torch.bfloat16])


OPS = [
    lambda *x, **k: castle_attention(*x, backend="torch", **k),
    lambda *x, **k: castle_attention(*x, backend="reference", **k),
    castle_parallel_reference,
    castle_recurrent,
]


@pytest.mark.parametrize("op", OPS, ids=["torch", "reference", "parallel", "recurrent"])
def test_rejects_bad_document_ids(op) -> None:
    inputs = make_inputs(2, 6, heads=1, dim=4)
    good = torch.tensor([[0, 0, 1, 1, 1, 2], [0] * 6], device=DEVICE)
    cases = [
        (good[:, :5], InputError, r"document_ids must have shape \[2, 6\]"),
        (good[0], InputError, r"document_ids must have shape \[2, 6\]"),
        (good.float(), InputTypeError, "document_ids must be an integer tensor"),
        (good.bool(), InputTypeError, "document_ids must be an integer tensor"),
        (good.tolist(), InputTypeError, "document_ids must be a torch.Tensor"),
        (good.flip(1), InputError, "document_ids decrease inside a row"),
        (torch.empty(2, 6, dtype=torch.long, device="meta"), InputError, "document_ids is on meta"),
    ]
    for ids, error, message in cases:
        with pytest.raises(error, match=message) as caught:
            op(*inputs, document_ids=ids)
        assert "\n" not in str(caught.value)
    op(*inputs, document_ids=good.int())  # any integer dtype
