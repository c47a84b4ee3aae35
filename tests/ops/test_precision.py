"""WidenedMatmuls: bf16/fp16 matrix products of CPU tensors as fp32 GEMMs, rounded back once."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from farsight.ops import precision as ops_precision
from farsight.ops.precision import WidenedMatmuls, software_matmul_dtypes, widened_matmuls

LOW = (torch.bfloat16, torch.float16)


def products(dtype):
    """(name, fn, inputs) for every product the mode takes over, with odd sizes."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        ("mm", torch.mm, (r(7, 13), r(13, 5))),
        ("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), (r(7, 5), r(7, 13), r(13, 5))),
        ("bmm", torch.bmm, (r(3, 7, 13), r(3, 13, 5))),
        ("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b, alpha=-1.0), (r(3, 7, 5), r(3, 7, 13), r(3, 13, 5))),
        ("mv", torch.mv, (r(7, 13), r(13))),
        ("addmv", torch.addmv, (r(7), r(7, 13), r(13))),
        ("linear", F.linear, (r(2, 7, 13), r(5, 13), r(5))),
        ("matmul", torch.matmul, (r(2, 3, 7, 13), r(2, 3, 13, 5))),
        ("einsum", lambda a, b: torch.einsum("bqd,bkd->bqk", a, b), (r(3, 7, 13), r(3, 5, 13))),
    ]


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])  # composites arrive whole under the latter
@pytest.mark.parametrize("dtype", LOW)
def test_each_product_is_the_fp32_product_rounded_once(dtype, grad_mode, widened_ops):
    for name, fn, inputs in products(dtype):
        widened_ops.clear()
        with getattr(torch, grad_mode)(), WidenedMatmuls(frozenset({dtype})):
            out = fn(*inputs)
        assert widened_ops, f"{name} was not taken over"
        # exactly the fp32 product rounded once (no second rounding, no product left in dtype)
        assert out.dtype == dtype and torch.equal(out, fn(*(x.float() for x in inputs)).to(dtype)), name
        # within one ulp of the exact product, and what torch's own kernel computes to its rounding
        assert_close(
            out.float(), fn(*(x.double() for x in inputs)).float(), rtol=torch.finfo(dtype).eps, atol=1e-5, msg=name
        )
        assert_close(out.float(), fn(*inputs).float(), rtol=4 * torch.finfo(dtype).eps, atol=1e-2, msg=name)


def test_other_dtypes_devices_and_mixes_are_left_to_torch(widened_ops):
    a, b = torch.randn(7, 13), torch.randn(13, 5)
    with WidenedMatmuls(frozenset({torch.bfloat16})):
        assert torch.equal(a @ b, torch.mm(a, b))  # fp32
        a.double() @ b.double()
        (a.half() @ b.half()).float()  # fp16 not in this mode's dtypes
        assert not widened_ops
        with pytest.raises(RuntimeError):  # a dtype mix keeps torch's error instead of widening it away
            a.bfloat16() @ b
        meta = torch.empty(7, 13, dtype=torch.bfloat16, device="meta")
        assert (meta @ meta.T).device.type == "meta"  # other devices
        assert not widened_ops
        a.bfloat16() @ b.bfloat16()
    assert widened_ops == ["mm"]


def test_empty_products(widened_ops):
    with WidenedMatmuls(frozenset({torch.bfloat16})):
        out = torch.randn(0, 4, dtype=torch.bfloat16) @ torch.randn(4, 3, dtype=torch.bfloat16)
        inner = torch.randn(5, 0, dtype=torch.bfloat16) @ torch.randn(0, 3, dtype=torch.bfloat16)
    assert out.shape == (0, 3) and out.dtype == torch.bfloat16
    assert torch.equal(inner, torch.zeros(5, 3, dtype=torch.bfloat16))
    assert widened_ops == ["mm", "mm"]


@pytest.mark.parametrize("dtype", LOW)
def test_gradients_of_a_small_network_match_torch_kernels(dtype, widened_ops):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.GELU(), torch.nn.Linear(32, 5)).to(dtype)
    x = torch.randn(9, 13, dtype=dtype, requires_grad=True)

    def grads():
        net.zero_grad()
        x.grad = None
        net(x).float().square().sum().backward()
        return [x.grad.float()] + [p.grad.float() for p in net.parameters()]

    reference = grads()
    with WidenedMatmuls(frozenset({dtype})):
        widened = grads()
    assert {"addmm", "mm"} <= set(widened_ops)  # forward and backward products
    for got, want in zip(widened, reference):
        assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bf16_autocast_training_step_matches_and_sdpa_backward_is_widened(widened_ops):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 16, requires_grad=True) for _ in range(3))
    proj = torch.nn.Linear(16, 16)

    def grads():
        for t in (q, k, v, proj.weight):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(proj(q), k, v, is_causal=True)
        out.float().sum().backward()
        return [t.grad for t in (q, k, v, proj.weight)]

    reference = grads()
    with WidenedMatmuls(frozenset({torch.bfloat16})):
        widened = grads()
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in widened_ops
    for got, want in zip(widened, reference):
        assert got.dtype == want.dtype
        assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_the_context_widens_only_what_the_cpu_lacks(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(ops_precision, "cpu_has_native_fp16", lambda: True)
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: True)
    assert software_matmul_dtypes(cpu) == frozenset()
    monkeypatch.setattr(ops_precision, "cpu_has_native_fp16", lambda: False)
    assert software_matmul_dtypes(cpu) == {torch.float16}
    assert not isinstance(widened_matmuls(cpu, torch.bfloat16, None), WidenedMatmuls)
    assert widened_matmuls(cpu, torch.float16).dtypes == {torch.float16}
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: False)
    assert widened_matmuls(cpu, torch.bfloat16, torch.float32).dtypes == {torch.bfloat16}
    assert not isinstance(widened_matmuls(cpu, torch.float32, None), WidenedMatmuls)
    assert software_matmul_dtypes(torch.device("cuda", 0)) == frozenset()
    assert not isinstance(widened_matmuls(torch.device("cuda", 0), torch.bfloat16), WidenedMatmuls)


@pytest.mark.parametrize(
    ("cap", "bf16", "fp16"),
    [
        (None, True, True),
        ("ALL", True, True),
        ("avx2", False, False),
        ("AVX512_CORE", False, False),
        ("AVX512_CORE_BF16", True, False),
        ("AVX10_1_512", True, True),
        ("AVX512_CORE_AMX_FP16", True, True),
    ],
)
def test_a_cpu_counts_the_instructions_onednn_may_use(monkeypatch, cap, bf16, fp16):
    # ONEDNN_MAX_CPU_ISA caps the instructions oneDNN runs torch's bf16/fp16 products with: below
    # AVX512_CORE_BF16 they are emulated, so a CPU that has the instructions counts as one without
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "avx512_fp16": True})
    monkeypatch.setattr(ops_precision.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    ops_precision.cpu_has_native_bf16.cache_clear()
    ops_precision.cpu_has_native_fp16.cache_clear()
    try:
        assert ops_precision.cpu_has_native_bf16() is bf16
        assert ops_precision.cpu_has_native_fp16() is fp16
        assert software_matmul_dtypes(torch.device("cpu")) == {
            dtype for dtype, native in ((torch.bfloat16, bf16), (torch.float16, fp16)) if not native
        }
    finally:
        ops_precision.cpu_has_native_bf16.cache_clear()
        ops_precision.cpu_has_native_fp16.cache_clear()
