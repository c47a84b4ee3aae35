"""Every model kind under bf16/fp16 autocast and in pure bf16: finite training steps with a
gradient for every parameter, sessions equal to the parallel forward within a bf16 tolerance,
and DRT chunk memory stored in bf16/fp16."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from farsight.data.tasks import CorpusFiller, make_task
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError
from farsight.eval.needle import evaluate_needle_task
from farsight.models import KV_DTYPES, DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM, load_model
from tests.tolerance import RMS_RATIO, assert_close_rms

V = 48
KINDS = ["causal", "sliding", "castle", "castle-swl", "drt"]
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-drt"


def make(kind):
    torch.manual_seed(0)
    if kind == "drt":
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
        )
        return DRTForCausalLM(cfg)
    extra = {"sliding": {"window": 6}, "castle-swl": {"lookahead_window": 5}}.get(kind, {})
    return TransformerForCausalLM(
        TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attention=kind, **extra)
    )


def ids(b, n, seed=1):
    return torch.randint(0, V - 4, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_under_autocast_reaches_every_parameter(kind, dtype):
    model = make(kind).train()
    x = ids(2, 37)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x, labels=x)
    assert out.logits.dtype == dtype
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        assert torch.isfinite(param.grad).all(), name
    # the fp32 step it approximates
    reference = make(kind).train()
    torch.manual_seed(1)
    want = reference(x, labels=x)
    torch.manual_seed(1)
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        got = model(x, labels=x)
    assert abs(got.loss.item() - want.loss.item()) < 0.05 * want.loss.item()


@pytest.mark.parametrize("kind", KINDS)
def test_a_pure_bf16_model_trains(kind):
    model = make(kind).to(torch.bfloat16).train()
    x = ids(4, 30)
    x[:, 15:] = x[:, :15]  # the second half repeats the first: learnable
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("mode", ["pure", "autocast"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_sessions_equal_the_parallel_forward(kind, mode):
    model = make(kind).eval()
    if mode == "pure":
        model = model.to(torch.bfloat16)
    x = ids(2, 41)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        full = model(x).logits
        with model.new_session(batch_size=2) as session:
            logits = [session.feed(x[:, :17])] + [session.step(x[:, i])[:, None] for i in range(17, 41)]
    got = torch.cat(logits, 1)
    assert got.dtype == torch.bfloat16
    assert_close_rms(f"{kind} {mode} session", full.detach(), got, RMS_RATIO[torch.bfloat16])


@pytest.mark.parametrize("memory", ["device", "host", "disk"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_drt_chunk_memory_in_half_precision(memory, kv_dtype):
    model = make("drt").eval()
    x = ids(2, 53)
    full = model(x).logits
    with model.new_session(batch_size=2, memory=memory, kv_dtype=kv_dtype) as session:
        got = session.feed(x)
        kv = session.memory.store.nbytes()
    with model.new_session(batch_size=2, memory=memory) as session:
        session.feed(x)
        assert kv * 2 == session.memory.store.nbytes()  # half the bytes of the fp32 K/V
    assert got.dtype == torch.float32
    assert_close_rms(f"{kv_dtype} chunk memory", full.detach(), got, RMS_RATIO[KV_DTYPES[kv_dtype]])


def test_kv_dtype_errors():
    with pytest.raises(InputError, match="not a storage dtype"):
        make("drt").new_session(kv_dtype="int8")
    with pytest.raises(InputError, match="kv_dtype"):
        make("causal").new_session(kv_dtype="fp16")


def _stdlib_filler(tokenizer):
    """Haystack text: a few modules of the running Python's standard library, byte-tokenized."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("argparse.py", "inspect.py", "typing.py"))
    tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return CorpusFiller(tokens, drop_ids=(tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id, tokenizer.lmk_id))


@pytest.mark.parametrize("memory", ["device", "disk"])
def test_fp16_chunk_memory_gives_the_demo_models_passkey_answers(memory):
    model, tokenizer = load_model(DEMO).eval(), load_tokenizer(DEMO)
    task = make_task("passkey", tokenizer, _stdlib_filler(tokenizer), model.config.chunk_size)

    def answers(kv_dtype):
        summary = evaluate_needle_task(
            model, task, [1024, 4096], [0.2, 0.8], trials=2, memory=memory, kv_dtype=kv_dtype, progress=False
        )
        return [t["predicted"] for t in summary["trials"]], summary

    fp32, summary = answers(None)
    fp16, _ = answers("fp16")
    assert fp16 == fp32
    assert all(row["exact_match"] == 1.0 for row in summary["by_length"].values())
