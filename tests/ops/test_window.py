import pytest
import torch

from farsight.ops.window import sliding_window_attention, sliding_window_attention_reference


def _inputs(b, tq, tk, h, d, dtype=torch.float64):
    q = torch.randn(b, tq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, tk, h, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, tk, h, d, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(
    "b,tq,tk,h,d,window,block",
    [
        (2, 37, 37, 3, 8, 5, None),  # T not a multiple of the block
        (1, 50, 50, 2, 4, 16, 7),  # several partial blocks
        (2, 5, 5, 1, 4, 16, None),  # T < W
        (1, 64, 64, 2, 8, 1, None),  # window of one: each query sees itself
        (1, 10, 25, 2, 4, 7, 3),  # queries after cached keys
        (1, 1, 9, 2, 4, 9, None),  # a decode step
    ],
)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_blockwise_matches_dense_reference(b, tq, tk, h, d, window, block, alibi, padding):
    q, k, v = _inputs(b, tq, tk, h, d)
    slopes = torch.rand(h, dtype=torch.float64) if alibi else None
    mask = (torch.rand(b, tk) > 0.3) if padding else None
    out = sliding_window_attention(q, k, v, window, slopes, key_padding_mask=mask, block_size=block)
    ref = sliding_window_attention_reference(q, k, v, window, slopes, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)


def test_reference_sees_exactly_the_window():
    # keys outside (p - W, p] must not influence position p
    q, k, v = _inputs(1, 12, 12, 1, 4)
    w = 3
    base = sliding_window_attention(q, k, v, w)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :5] += 10
    v2[:, :5] += 10
    moved = sliding_window_attention(q, k2, v2, w)
    torch.testing.assert_close(moved[:, 5 + w - 1 :], base[:, 5 + w - 1 :])
    assert not torch.allclose(moved[:, 5:7], base[:, 5:7])


def test_memory_is_linear_in_length():
    # the saved score tile has block + W - 1 columns, never T
    q, k, v = _inputs(1, 512, 512, 1, 8, torch.float32)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sliding_window_attention(q, k, v, 16)
    assert max(sizes) < 512 * 512 / 4


def test_bf16_runs_in_float32():
    q, k, v = _inputs(1, 20, 20, 2, 8, torch.float32)
    out = sliding_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sliding_window_attention_reference(q, k, v, 6), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(window=0), "window"),
        (dict(k=torch.randn(1, 3, 2, 4), v=torch.randn(1, 3, 2, 4)), "q has"),
        (dict(v=torch.randn(1, 5, 2, 3)), "v must have shape"),
        (dict(k=torch.randn(1, 5, 2, 4, dtype=torch.float64)), "dtype"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
        (dict(key_padding_mask=torch.ones(1, 5)), "bool"),
    ],
)
def test_bad_inputs_name_the_problem(args, message):
    base = dict(q=torch.randn(1, 5, 2, 4), k=torch.randn(1, 5, 2, 4), v=torch.randn(1, 5, 2, 4), window=3)
    base.update(args)
    with pytest.raises((ValueError, TypeError), match=message):
        sliding_window_attention(**base)


# Backends: "auto" keeps the blockwise path on CPU; "sdpa" runs anywhere; "flex" is CUDA-only
# through the dispatcher, and its masks are checked here by running FlexAttention eagerly
# (forward only: FlexAttention has no CPU backward).
BACKEND_CASES = [
    (2, 37, 37, 3, 8, 5),  # T not a multiple of anything
    (1, 10, 25, 2, 4, 7),  # queries after cached keys
    (1, 1, 9, 2, 4, 9),  # a decode step
]


def test_auto_backend_is_blockwise_on_cpu(monkeypatch):
    from farsight.ops import window as window_ops

    q, k, v = _inputs(1, 200, 200, 2, 8, torch.float32)
    assert window_ops.resolve_backend("auto", q) == "blockwise"

    def fail(*args, **kwargs):
        raise AssertionError("auto left the blockwise path on CPU")

    monkeypatch.setattr(window_ops, "sliding_window_attention_flex", fail)
    monkeypatch.setattr(window_ops, "sliding_window_attention_sdpa", fail)
    out = window_ops.sliding_window_attention(q, k, v, 16)
    torch.testing.assert_close(out, sliding_window_attention_reference(q, k, v, 16), atol=1e-5, rtol=1e-5)


def test_unavailable_or_unknown_backend_is_a_clear_error():
    q, k, v = _inputs(1, 5, 5, 2, 4, torch.float32)
    with pytest.raises(RuntimeError, match='backend="flex" needs CUDA tensors'):
        sliding_window_attention(q, k, v, 3, backend="flex")
    with pytest.raises(ValueError, match="backend must be one of"):
        sliding_window_attention(q, k, v, 3, backend="flash")


def attention_query_by_query(q, k, v, window, slopes, key_padding_mask):
    """The definition, one query and head at a time: query i at position p = Tk - Tq + i attends
    to the keys j with p - window < j <= p (padding hidden, but never its own key), with scores
    q . k / sqrt(d) - slope * (p - j)."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    out = torch.zeros_like(q)
    for row in range(b):
        for i in range(tq):
            p = tk - tq + i
            seen = [
                j
                for j in range(max(0, p - window + 1), p + 1)
                if key_padding_mask is None or key_padding_mask[row, j] or j == p
            ]
            for head in range(h):
                scores = k[row, seen, head] @ q[row, i, head] / d**0.5
                if slopes is not None:
                    scores = scores - slopes[head] * (p - torch.tensor(seen, dtype=scores.dtype))
                out[row, i, head] = torch.softmax(scores, dim=0) @ v[row, seen, head]
    return out


@pytest.mark.parametrize("b,tq,tk,h,d,window", BACKEND_CASES)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_reference_follows_the_definition_query_by_query(b, tq, tk, h, d, window, alibi, padding):
    """What judges every backend, judged by the definition written out (no shared mask code)."""
    q, k, v = (x.detach() for x in _inputs(b, tq, tk, h, d))
    slopes = torch.rand(h, dtype=torch.float64) if alibi else None
    mask = (torch.rand(b, tk) > 0.3) if padding else None
    ref = sliding_window_attention_reference(q, k, v, window, slopes, key_padding_mask=mask)
    torch.testing.assert_close(ref, attention_query_by_query(q, k, v, window, slopes, mask), atol=1e-12, rtol=0)


@pytest.mark.parametrize("b,tq,tk,h,d,window", BACKEND_CASES)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_sdpa_backend_matches_reference(b, tq, tk, h, d, window, alibi, padding):
    q, k, v = _inputs(b, tq, tk, h, d)
    slopes = torch.rand(h, dtype=torch.float64) if alibi else None
    mask = (torch.rand(b, tk) > 0.3) if padding else None
    out = sliding_window_attention(q, k, v, window, slopes, key_padding_mask=mask, backend="sdpa")
    ref = sliding_window_attention_reference(q, k, v, window, slopes, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad = torch.randn_like(out)
    for g1, g2 in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("b,tq,tk,h,d,window", BACKEND_CASES)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_flex_masks_match_reference_eagerly(b, tq, tk, h, d, window, alibi, padding):
    from farsight.ops.window import flex_available, sliding_window_attention_flex

    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    q, k, v = (x.detach() for x in _inputs(b, tq, tk, h, d, torch.float32))
    slopes = torch.rand(h) if alibi else None
    mask = (torch.rand(b, tk) > 0.3) if padding else None
    ref = sliding_window_attention_reference(q, k, v, window, slopes, key_padding_mask=mask)
    for block_size in (None, 16):  # the default tile, and one smaller than the inputs
        out = sliding_window_attention_flex(
            q, k, v, window, slopes, key_padding_mask=mask, compile=False, block_size=block_size
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [0, 24, 8, 64.0])
def test_flex_block_size_must_be_a_power_of_two_tile(block_size):
    from farsight.errors import InputError
    from farsight.ops.window import flex_available, sliding_window_attention_flex

    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    q, k, v = (x.detach() for x in _inputs(1, 8, 8, 1, 4, torch.float32))
    with pytest.raises(InputError, match="block_size must be a power of two >= 16"):
        sliding_window_attention_flex(q, k, v, 3, compile=False, block_size=block_size)
