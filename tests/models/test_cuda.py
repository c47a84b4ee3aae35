"""Every model kind on a CUDA GPU, against the same model on the CPU: a training step in fp32 and
under bf16/fp16 autocast (with triton installed CUDA picks the Triton GCA and CASTLE kernels; at
these 37 tokens the sliding window runs the blockwise op, FlexAttention being for 128 queries and
more), streaming sessions on each chunk-memory tier, and CASTLE decoding on both ways of updating
U, all at odd sizes; and a compiled training step (the trainer's torch.compile) against the eager
one, at 160 tokens, where the window op takes FlexAttention.

Skipped without a GPU (CI has none); `experiments/gpu-check.sh` runs these natively on a lent
machine, with the ops' own CUDA cases (tests/ops/test_autocast.py, FlexAttention included, and the
Triton kernel tests).
"""

import pytest
import torch

from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM
from farsight.ops.castle import castle_decode, castle_parallel_reference, castle_prefill, inference
from tests.models.test_precision import KINDS, V, ids
from tests.models.test_precision import make as make_cpu_model
from tests.tolerance import RMS_RATIO, assert_close_rms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(kind):
    """The tests' small model of `kind`; DRT without Gumbel noise, whose draws differ between
    the CPU and CUDA generators (the retrieval would then differ, not the arithmetic)."""
    if kind != "drt":
        return make_cpu_model(kind)
    torch.manual_seed(0)
    cfg = DRTConfig(
        vocab_size=V,
        d_model=32,
        n_layers=4,
        n_heads=2,
        chunk_size=5,
        window=12,
        top_k=2,
        groups=2,
        encoder_layers=1,
        gumbel=False,
    )
    return DRTForCausalLM(cfg)


def step(model, x, dtype=None):
    """Loss and parameter gradients of one training step (autocast to `dtype` when given)."""
    model.zero_grad()
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        out = model(x.to(device), labels=x.to(device))
    out.loss.backward()
    return out, {name: p.grad.detach().cpu() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_training_step_on_cuda_equals_the_cpu_step(kind):
    x = ids(2, 37)
    want, want_grads = step(make(kind).train(), x)
    got, got_grads = step(make(kind).cuda().train(), x)
    assert abs(got.loss.item() - want.loss.item()) < 1e-4 * want.loss.item()
    for name, grad in want_grads.items():
        assert_close_rms(f"{kind} d{name}", grad, got_grads[name], 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_training_step_on_cuda_approximates_the_cpu_fp32_step(kind, dtype):
    x = ids(2, 37)
    want, want_grads = step(make(kind).train(), x)
    got, got_grads = step(make(kind).cuda().train(), x, dtype)
    assert got.logits.dtype == dtype
    assert abs(got.loss.item() - want.loss.item()) < 0.02 * want.loss.item()
    for name, grad in got_grads.items():
        assert torch.isfinite(grad).all(), name
    # all gradients as one vector: a parameter whose gradient is tiny (a norm weight's, ~1e-5)
    # can be off by more than the dtype's tolerance on its own, on the CPU too
    flat = [torch.cat([grads[name].flatten() for name in want_grads]) for grads in (want_grads, got_grads)]
    assert_close_rms(f"{kind} gradients", *flat, 2 * RMS_RATIO[dtype])


def compiled_against_eager(kind, device, dtype=torch.bfloat16, length=160):
    """Parameter gradients of one autocast training step of `kind` as the trainer takes it (the
    loss alone, `return_logits=False`), eager and then through the trainer's torch.compile
    (farsight.train.compile), on the same batch. 160 tokens: the sliding window takes
    FlexAttention on CUDA (128 queries and more). "sliding-16k" has a 16,384-entry vocabulary,
    whose loss head is the chunked loss (CHUNKED_LOSS_MIN_VOCAB), as the BPE models'."""
    from farsight.train.compile import compile_model

    if kind == "sliding-16k":
        torch.manual_seed(0)
        config = TransformerConfig(vocab_size=16384, d_model=32, n_layers=2, n_heads=4, attention="sliding", window=6)
        model = TransformerForCausalLM(config)
    else:
        model = make(kind)
    model = model.to(device).train()
    x = ids(2, length).to(device)

    def gradients():
        model.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, labels=x, return_logits=False).loss
        loss.backward()
        return {name: p.grad.detach().float().cpu() for name, p in model.named_parameters()}

    eager = gradients()
    compiled = compile_model(model)
    try:
        return eager, gradients()
    finally:
        compiled.remove()


@pytest.mark.parametrize("kind", [*KINDS, "sliding-16k"])
def test_compiled_training_step_on_cuda_has_the_eager_gradients(kind):
    """On an H200 the compiled BPE baselm-2l trained with a gradient of exactly 0 (its loss stayed
    at ln(vocabulary)); compiled and eager steps must give every parameter the same gradient."""
    eager, got = compiled_against_eager(kind, "cuda")
    for name, grad in got.items():
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0 or eager[name].abs().sum() == 0, f"{name}: no gradient when compiled"
    flat = [torch.cat([grads[name].flatten() for name in eager]) for grads in (eager, got)]
    assert_close_rms(f"{kind} compiled gradients", *flat, 2 * RMS_RATIO[torch.bfloat16])


@pytest.mark.parametrize("memory", ["device", "host", "disk"])
@pytest.mark.parametrize("kind", KINDS)
def test_session_on_cuda_equals_the_cpu_session(kind, memory):
    if memory != "device" and kind != "drt":
        pytest.skip("chunk-memory tiers are DRT's")
    x = ids(2, 53)
    options = {"memory": memory} if kind == "drt" else {}

    def stream(model):
        device = next(model.parameters()).device
        with model.new_session(batch_size=2, **options) as session:
            logits = [session.feed(x[:, :23].to(device))] + [
                session.step(x[:, i].to(device))[:, None] for i in range(23, 53)
            ]
        return torch.cat(logits, 1).cpu()

    with torch.no_grad():
        want = stream(make(kind).eval())
        got = stream(make(kind).cuda().eval())
    assert_close_rms(f"{kind} {memory}", want, got, 1e-4)


@pytest.mark.parametrize("held_back", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_castle_decode_on_cuda_follows_the_definition(monkeypatch, window, held_back):
    """fp32 on the GPU against the fp64 reference on the CPU: a 19-token prefill, then 40 steps
    (the cache grows, and with held-back updates more than two folds happen)."""
    if held_back:
        monkeypatch.setattr(inference, "HOLD_BACK_FROM_ROWS", 1)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 59, 3, 16, generator=gen, dtype=torch.float64) for _ in range(6)]
    want = castle_parallel_reference(*inputs, window=window)
    on_gpu = [x.float().cuda() for x in inputs]
    out, cache = castle_prefill(*(x[:, :19] for x in on_gpu), window=window)
    outs = [out]
    for t in range(19, 59):
        step_out, cache = castle_decode(*(x[:, t : t + 1] for x in on_gpu), cache)
        outs.append(step_out)
    got = torch.cat(outs, dim=1).cpu().double()
    assert (got - want).abs().max() < 1e-4
    _, whole = castle_prefill(*(x.double() for x in inputs), window=window)
    assert (cache.u.cpu().double() - whole.u).abs().max() < 1e-4
