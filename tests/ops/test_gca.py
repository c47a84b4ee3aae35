"""GCA op: the recomputing PyTorch path against the naive reference, memory, and input checks."""

from __future__ import annotations

import pytest
import torch

from farsight.ops.gca import gca, gca_recompute, gca_reference


def make_inputs(
    batch: int = 2,
    n: int = 3,
    m: int = 4,
    s: int = 5,
    heads: int = 3,
    dim: int = 4,
    lq: int | None = None,
    index: list | None = None,
    n_slots: int = 2,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, ...]:
    """q [B, n, Lq, H, d], k/v [B, m, S, H, d], index/weight [B, n, K]; Lq defaults to S + 1."""
    lq = s + 1 if lq is None else lq
    q = torch.randn(batch, n, lq, heads, dim, dtype=dtype)
    k = torch.randn(batch, m, s, heads, dim, dtype=dtype)
    v = torch.randn(batch, m, s, heads, dim, dtype=dtype)
    if index is None:
        idx = torch.randint(-1, m, (batch, n, n_slots))
    else:
        idx = torch.tensor(index, dtype=torch.long)
    weight = torch.randn(idx.shape, dtype=dtype).softmax(dim=-1)
    return q, k, v, idx, weight


def outputs_and_grads(fn, q, k, v, index, weight, **kwargs) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, weight)]
    lq, lk, lv, lw = leaves
    out = fn(lq, lk, lv, index, lw, **kwargs)
    # A fixed random cotangent exercises every output element with a different weight.
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * cotangent).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def assert_match(inputs, atol: float = 1e-10, **kwargs) -> list[torch.Tensor]:
    got = outputs_and_grads(gca_recompute, *inputs, **kwargs)
    want = outputs_and_grads(gca_reference, *inputs, **kwargs)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dweight"), got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    return got


@pytest.mark.parametrize("softmax_one", [True, False])
@pytest.mark.parametrize("s", [5, 7, 8])
def test_recompute_matches_reference(softmax_one: bool, s: int) -> None:
    assert_match(make_inputs(s=s, n_slots=3), softmax_one=softmax_one)


def test_softmax_one_changes_result() -> None:
    inputs = make_inputs()
    on = gca(*inputs, softmax_one=True)
    off = gca(*inputs, softmax_one=False)
    assert (on - off).abs().max() > 1e-3
    # softmax_1 never gives more total mass than softmax: exp(x) / (1 + sum) < exp(x) / sum.
    index = torch.zeros(1, 1, 1, dtype=torch.long)
    q, k, _, _, w = make_inputs(batch=1, n=1, m=1, index=index.tolist())
    ones = torch.ones_like(k)
    assert bool((gca(q, k, ones, index, w, softmax_one=True) < 1).all())
    torch.testing.assert_close(gca(q, k, ones, index, w, softmax_one=False), torch.ones_like(q))


def test_empty_slots_and_all_empty_chunk() -> None:
    index = [[[1, -1, 0], [-1, -1, -1], [2, 3, -1]], [[-1, 0, -1], [3, -1, 2], [-1, -1, -1]]]
    inputs = make_inputs(index=index)
    o, _, _, _, dw = assert_match(inputs)
    assert bool((o[0, 1] == 0).all()) and bool((o[1, 2] == 0).all())
    empty = torch.tensor(index) < 0
    assert bool((dw[empty] == 0).all())
    assert bool((dw[~empty] != 0).all())


def test_empty_slot_weight_is_ignored() -> None:
    q, k, v, index, weight = make_inputs(index=[[[0, -1]] * 3] * 2)
    noisy = weight.clone()
    noisy[..., 1] = float("nan")
    torch.testing.assert_close(gca(q, k, v, index, noisy), gca(q, k, v, index, weight))


def test_more_slots_than_memory_chunks() -> None:
    # K = 6 slots but only m = 2 chunks: most slots are -1, some chunks are picked twice.
    index = torch.randint(-1, 2, (2, 3, 6))
    index[0, 0] = torch.tensor([0, 1, -1, -1, -1, -1])
    inputs = make_inputs(m=2, s=7, index=index.tolist())
    assert_match(inputs, softmax_one=True)
    assert_match(inputs, softmax_one=False)


def test_repeated_chunks_accumulate_gradients() -> None:
    # Chunk 1 read by every query chunk, and twice by the first one.
    index = [[[1, 1, 0], [1, 2, -1], [3, 1, 1]]] * 2
    _, _, dk, dv, _ = assert_match(make_inputs(index=index))
    assert bool((dk[:, 1] != 0).all()) and bool((dv[:, 1] != 0).all())


@pytest.mark.parametrize("softmax_one", [True, False])
def test_extreme_scores_stay_finite(softmax_one: bool) -> None:
    # Scores in the +-1000s; with k > 0, even query rows see only very negative scores.
    q, k, v, index, weight = make_inputs(n_slots=3)
    k = k.abs()
    q = q.abs() * 300
    q[:, :, ::2] = -q[:, :, ::2]
    o = assert_match((q, k, v, index, weight), atol=1e-9, softmax_one=softmax_one)[0]
    if softmax_one:  # all logits far below the implicit zero logit: almost nothing is attended
        assert o[:, :, ::2].abs().max() < 1e-6


def test_query_rows_need_not_be_s_plus_one() -> None:
    assert_match(make_inputs(s=6, lq=1))
    assert_match(make_inputs(s=3, lq=9, n_slots=4))


def test_no_memory_chunks() -> None:
    q, k, v, index, weight = make_inputs(m=0, index=[[[-1, -1]] * 3] * 2)
    for fn in (gca_recompute, gca_reference):
        o, dq, dk, dv, dw = outputs_and_grads(fn, q, k, v, index, weight)
        assert bool((o == 0).all()) and bool((dq == 0).all()) and bool((dw == 0).all())
        assert dk.shape == k.shape and dv.shape == v.shape


def test_custom_scale_and_partial_grads() -> None:
    q, k, v, index, weight = make_inputs()
    assert_match((q, k, v, index, weight), scale=0.3)
    # Only k needs a gradient: the backward skips the rest and still agrees.
    k1 = k.clone().requires_grad_(True)
    k2 = k.clone().requires_grad_(True)
    gca_recompute(q, k1, v, index, weight).square().sum().backward()
    gca_reference(q, k2, v, index, weight).square().sum().backward()
    torch.testing.assert_close(k1.grad, k2.grad, atol=1e-10, rtol=0)


def test_gradcheck_tiny() -> None:
    q, k, v, index, weight = make_inputs(batch=1, n=2, m=2, s=3, heads=2, dim=2, index=[[[1, -1], [0, 1]]])
    leaves = [x.requires_grad_(True) for x in (q, k, v, weight)]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gca_recompute(q, k, v, index, weight)

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_fp32(dtype: torch.dtype) -> None:
    inputs = make_inputs(s=7, n_slots=3, dtype=torch.float32)
    low = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    got = outputs_and_grads(gca, *low)
    want = outputs_and_grads(gca, *[x.to(dtype).float() if x.is_floating_point() else x for x in inputs])
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, atol=3e-2, rtol=3e-2)


def test_backward_keeps_no_gathered_copy() -> None:
    batch, n, m, s, heads, dim, n_slots = 2, 3, 5, 4, 2, 3, 4
    q, k, v, index, weight = make_inputs(batch, n, m, s, heads, dim, n_slots=n_slots)
    gathered = batch * n * n_slots * s * heads * dim
    assert gathered not in {x.numel() for x in (q, k, v, index, weight)}

    def saved_sizes(fn) -> list[int]:
        sizes: list[int] = []

        def pack(x: torch.Tensor) -> torch.Tensor:
            sizes.append(x.numel())
            return x

        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, weight)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(leaves[0], leaves[1], leaves[2], index, leaves[3])
        return sizes

    assert gathered in saved_sizes(gca_reference)  # the hook sees what the naive path keeps
    sizes = saved_sizes(gca_recompute)
    # Only the inputs themselves and the probabilities per (batch, chunk, head, row, slot, key
    # and softmax_1's zero key): linear in the sequence like the inputs, without the d factor.
    lq = q.shape[2]
    allowed = {x.numel() for x in (q, k, v, index, weight)} | {batch * n * heads * lq * n_slots * (s + 1)}
    assert gathered not in sizes and set(sizes) <= allowed


def test_backends_agree() -> None:
    inputs = make_inputs(n_slots=3)
    want = gca(*inputs, backend="reference")
    torch.testing.assert_close(gca(*inputs, backend="torch"), want, atol=1e-10, rtol=0)
    torch.testing.assert_close(gca(*inputs), want, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        gca(*inputs, backend="cuda")


def _replace(inputs: tuple, **changes) -> tuple:
    names = ("q", "k", "v", "index", "weight")
    return tuple(changes.get(name, x) for name, x in zip(names, inputs))


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda q, k, v, i, w: {"q": q[0]}, ValueError, "q must have 5 dimensions"),
        (lambda q, k, v, i, w: {"k": k[:, :, :, :2]}, ValueError, r"k must have shape \[2, \*, \*, 3, 4\]"),
        (lambda q, k, v, i, w: {"k": k[..., :3], "v": v[..., :3]}, ValueError, r"got \[2, 4, 5, 3, 3\]"),
        (lambda q, k, v, i, w: {"k": k[:1], "v": v[:1]}, ValueError, "with B, H, d of q"),
        (lambda q, k, v, i, w: {"v": v[:, :2]}, ValueError, r"v must have shape .*\(same shape as k\)"),
        (lambda q, k, v, i, w: {"index": i[:, :2]}, ValueError, r"index must have shape \[2, 3, \*\]"),
        (lambda q, k, v, i, w: {"weight": w[..., :1]}, ValueError, "weight must have shape"),
        (lambda q, k, v, i, w: {"index": i.int()}, TypeError, r"index must be a torch.long .* index.long\(\)"),
        (lambda q, k, v, i, w: {"index": i.float()}, TypeError, "index must be a torch.long"),
        (lambda q, k, v, i, w: {"index": i + 4}, ValueError, r"index values must lie in \[-1, 4\)"),
        (lambda q, k, v, i, w: {"index": i - 5}, ValueError, "replace missing chunks by -1"),
        (lambda q, k, v, i, w: {"weight": w.half()}, TypeError, "weight has dtype torch.float16 .* cast weight to"),
        (lambda q, k, v, i, w: {"v": v.float()}, TypeError, "cast them to one dtype"),
        (lambda q, k, v, i, w: {"q": q.long()}, TypeError, "q must be a floating-point tensor"),
        (lambda q, k, v, i, w: {"index": i[..., :0], "weight": w[..., :0]}, ValueError, "K >= 1"),
        (lambda q, k, v, i, w: {"k": k[:, :, :0], "v": v[:, :, :0]}, ValueError, r"S=0\) .* must all be >= 1"),
        (lambda q, k, v, i, w: {"weight": w.tolist()}, TypeError, "weight must be a torch.Tensor"),
        (lambda q, k, v, i, w: {"index": i.to("meta")}, ValueError, "index is on meta"),
        (lambda q, k, v, i, w: {"weight": w.to("meta")}, ValueError, "move them to one device"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, error, message: str) -> None:
    inputs = make_inputs(index=[[[0, 1], [2, -1], [3, 3]]] * 2)
    with pytest.raises(error, match=message):
        gca(*_replace(inputs, **change(*inputs)))


def test_bad_scale_and_missing_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs()
    with pytest.raises(TypeError, match="scale must be a float or None"):
        gca(*inputs, scale=torch.tensor(0.5))
    import farsight.ops.backend as ops_backend

    monkeypatch.setattr(ops_backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match='backend="triton" needs the triton package'):
        gca(*inputs, backend="triton")


@pytest.mark.parametrize("softmax_one", [True, False])
def test_inference_path_without_grad_matches_reference(softmax_one):
    # under no_grad gca_recompute runs all K slots in one batched pass
    torch.manual_seed(3)
    q = torch.randn(2, 4, 6, 3, 8, dtype=torch.float64)
    k = torch.randn(2, 5, 7, 3, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    index = torch.tensor([[[0, -1, 4], [2, 2, -1], [-1, -1, -1], [1, 3, 0]]] * 2)
    weight = torch.rand(2, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        got = gca(q, k, v, index, weight, softmax_one=softmax_one, backend="torch")
    want = gca_reference(q, k, v, index, weight, softmax_one=softmax_one)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert torch.count_nonzero(got[:, 2]) == 0


def _key_mask(index: torch.Tensor, s: int, seed: int = 5) -> torch.Tensor:
    """A random [B, n, K, S] key mask with some slots fully masked."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*index.shape, s, generator=g) > 0.4
    mask[0, 0, 0] = False  # a slot with no real key
    mask[-1, -1, -1] = True
    return mask


@pytest.mark.parametrize("softmax_one", [True, False])
def test_key_mask_recompute_matches_reference(softmax_one: bool) -> None:
    inputs = make_inputs(s=7, n_slots=3, index=[[[0, 1, 2], [2, -1, 3], [3, 3, 0]]] * 2)
    got = assert_match(inputs, softmax_one=softmax_one, key_mask=_key_mask(inputs[3], 7))
    assert all(torch.isfinite(x).all() for x in got)


@pytest.mark.parametrize("softmax_one", [True, False])
def test_key_mask_equals_dropping_the_masked_keys(softmax_one: bool) -> None:
    # independent definition: a chunk whose first p keys are masked attends like the chunk cut
    # to its last S - p keys (the left padding of DRT's first prompt chunk)
    torch.manual_seed(0)
    q, k, v, _, _ = make_inputs(batch=1, n=1, m=1, s=6)
    index, weight = torch.zeros(1, 1, 1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.float64)
    mask = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    mask[..., 2:] = True
    for backend in ("torch", "reference"):
        got = gca(q, k, v, index, weight, softmax_one=softmax_one, key_mask=mask, backend=backend)
        want = gca_reference(q, k[:, :, 2:], v[:, :, 2:], index, weight, softmax_one=softmax_one)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("softmax_one", [True, False])
def test_key_mask_inference_path_and_fully_masked_slot(softmax_one: bool) -> None:
    q, k, v, index, weight = make_inputs(s=5, n_slots=3, index=[[[0, 1, -1], [2, 2, 3], [1, 0, 3]]] * 2)
    mask = _key_mask(index, 5)
    with torch.no_grad():
        got = gca(q, k, v, index, weight, softmax_one=softmax_one, key_mask=mask)
    want = gca_reference(q, k, v, index, weight, softmax_one=softmax_one, key_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the fully masked slot adds exactly what an empty slot adds: nothing
    emptied = torch.where(mask.any(-1), index, -1)
    without = gca_reference(q, k, v, emptied, weight, softmax_one=softmax_one, key_mask=mask)
    torch.testing.assert_close(want, without, atol=1e-12, rtol=0)
    full = gca_reference(q, k, v, index, weight, softmax_one=softmax_one, key_mask=torch.ones_like(mask))
    torch.testing.assert_close(full, gca_reference(q, k, v, index, weight, softmax_one=softmax_one), atol=0, rtol=0)


def test_key_mask_bad_inputs() -> None:
    q, k, v, index, weight = make_inputs()
    with pytest.raises(ValueError, match=r"key_mask must have shape \[2, 3, 2, 5\]"):
        gca(q, k, v, index, weight, key_mask=torch.ones(2, 3, 2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
        gca(q, k, v, index, weight, key_mask=torch.ones(2, 3, 2, 5))


def test_key_mask_under_autocast_bf16():
    q, k, v, index, weight = make_inputs(dtype=torch.float32, index=[[[0, 1], [2, -1], [3, 3]]] * 2)
    mask = _key_mask(index, 5)
    want = gca_reference(q, k, v, index, weight, key_mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gca(q, k, v, index, weight, key_mask=mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softmax_one", [True, False])
def test_inference_path_in_low_precision_matches_fp64(dtype: torch.dtype, softmax_one: bool) -> None:
    # the no-grad pass multiplies in the input dtype: within a relative tolerance of the fp64
    # reference, with empty slots, a repeated chunk, a fully masked slot and odd sizes
    torch.manual_seed(4)
    q, k, v, index, weight = make_inputs(batch=2, n=3, m=4, s=7, heads=3, dim=5, n_slots=3, dtype=torch.float64)
    index = torch.tensor([[[0, 3, -1], [2, 2, 1], [1, -1, 3]]] * 2)
    mask = _key_mask(index, 7)
    want = gca_reference(q, k, v, index, weight, softmax_one=softmax_one, key_mask=mask)
    with torch.no_grad():
        got = gca(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            index,
            weight.float(),
            softmax_one=softmax_one,
            key_mask=mask,
            backend="torch",
        )
    assert got.dtype == dtype
    error = (got.double() - want).norm() / want.norm()
    assert error < (0.02 if dtype == torch.bfloat16 else 0.005), error
