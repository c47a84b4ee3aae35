"""train.compile: compiled blocks and loss give the eager losses and gradients, keep the
checkpoint names, resume bit-identically, fall back to eager with one note, and run under DDP.

Small shapes: each compiled model kind costs a few seconds of inductor compilation (less once
torch's cache under /tmp holds its kernels).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM
from farsight.train.checkpoint import list_checkpoints
from farsight.train.compile import AUTO_MIN_STEPS, compile_model, eager, resolve_compile
from farsight.train.precision import flush_denormals
from farsight.train.trainer import Trainer, train
from tests.tolerance import RMS_RATIO, assert_close_rms
from tests.train.conftest import tiny_config, tiny_sft_config

CPU = torch.device("cpu")


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
    if kind == "drt":
        return DRTForCausalLM(DRTConfig(**sizes, chunk_size=8, window=16, top_k=2, encoder_layers=1))
    extra = {"sliding": {"window": 16}, "castle-swl": {"lookahead_window": 8}}.get(kind, {})
    return TransformerForCausalLM(TransformerConfig(**sizes, attention=kind, **extra))


def _loss_and_grads(model, ids, dtype=None):
    torch.manual_seed(3)  # the same Gumbel noise for a training DRT's retrieval every time
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(ids, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


# Each compiled model kind costs seconds of compilation on a fresh machine, so the default run
# compiles two: CASTLE (the transformer's blocks) and DRT, whose lower layers are sliding-window
# layers (and test_packing.py trains a compiled sliding transformer). The causal and sliding
# transformers alone are slow cases.
SLIDING = pytest.param("sliding", marks=pytest.mark.slow)


@pytest.mark.parametrize("kind", [SLIDING, pytest.param("causal", marks=pytest.mark.slow), "castle", "drt"])
def test_compiled_fp32_loss_and_gradients_equal_eager(kind):
    model = _model(kind)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with flush_denormals(CPU):
        want_loss, want = _loss_and_grads(model, ids)
        compiled = compile_model(model)
        got_loss, got = _loss_and_grads(model, ids)
        with eager(compiled):  # the eager modules are still there
            again_loss, _ = _loss_and_grads(model, ids)
    assert torch.equal(again_loss, want_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    # Within 1e-6 of the model's largest gradient entry; per tensor within 2e-6 in norm (a few
    # fp32 ulps: DRT's retriever gradients are 1e-7-sized sums of larger terms).
    largest = max(grad.abs().max().item() for grad in want.values())
    for name, grad in want.items():
        error = (got[name] - grad).abs()
        assert error.max().item() <= 1e-6 * largest, name
        assert error.norm().item() <= 2e-6 * grad.norm().item() or error.max().item() == 0, name
    compiled.remove()
    assert "forward" not in vars(model.blocks[0] if hasattr(model, "blocks") else model.lower[0])


@pytest.mark.parametrize("kind", [SLIDING, "drt"])
def test_compiled_bf16_mixed_matches_eager_within_bf16_tolerance(kind):
    model = _model(kind)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    want_loss, want = _loss_and_grads(model, ids, torch.bfloat16)
    compile_model(model)
    got_loss, got = _loss_and_grads(model, ids, torch.bfloat16)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-2, atol=0)
    for name, grad in want.items():
        assert_close_rms(name, grad, got[name], RMS_RATIO[torch.bfloat16])


def test_compiled_model_keeps_its_state_dict_names():
    model = _model("drt")
    names = list(model.state_dict())
    compile_model(model)
    assert list(model.state_dict()) == names
    assert not any("_orig_mod" in name for name in model.state_dict())


def test_auto_compiles_long_cpu_runs_only():
    assert resolve_compile("auto", CPU, AUTO_MIN_STEPS, sharded=False, widened=False)[0]
    assert not resolve_compile("auto", CPU, AUTO_MIN_STEPS - 1, sharded=False, widened=False)[0]
    assert not resolve_compile("auto", CPU, 10**6, sharded=True, widened=False)[0]
    assert not resolve_compile("auto", CPU, 10**6, sharded=False, widened=True)[0]
    assert not resolve_compile("auto", torch.device("cuda", 0), 10**6, sharded=False, widened=False)[0]
    assert resolve_compile("auto", CPU, 10**6, sharded=False, widened=False, varying_shapes=True) == (
        False,
        "batch shapes vary from step to step, and each new shape would recompile",
    )
    assert resolve_compile(True, CPU, 1, sharded=True, widened=True) == (True, None)
    assert resolve_compile(False, CPU, 10**6, sharded=False, widened=False) == (False, None)


def test_compile_setting_is_checked(token_dir, tmp_path):
    from farsight.config import ConfigError

    with pytest.raises(ConfigError, match="train.compile must be auto, true or false"):
        tiny_config(token_dir, tmp_path, compile="yes")


def test_auto_leaves_supervised_batches_of_varying_width_eager(sft_dir, tmp_path, farsight_log):
    trainer = Trainer(tiny_sft_config(sft_dir, tmp_path / "run", steps=AUTO_MIN_STEPS, compile="auto"))
    assert trainer.compiled is None
    step = trainer._train_step

    def step_then_ctrl_c():
        out = step()
        signal.raise_signal(signal.SIGINT)
        return out

    trainer._train_step = step_then_ctrl_c
    assert trainer.fit().status == "interrupted"
    trainer.close()
    assert "not compiling (train.compile=auto): batch shapes vary" in farsight_log.text


@pytest.mark.slow  # resuming is checked eagerly (tests/train/test_trainer.py), compiled training in test_packing.py
def test_resume_with_compile_is_bit_identical(token_dir, tmp_path):
    straight = train(tiny_config(token_dir, tmp_path / "a", compile=True))

    trainer = Trainer(tiny_config(token_dir, tmp_path / "b", compile=True))
    assert trainer.compiled is not None
    step = trainer._train_step

    def step_then_ctrl_c():
        out = step()
        if trainer.step == 3:
            signal.raise_signal(signal.SIGINT)
        return out

    trainer._train_step = step_then_ctrl_c
    first = trainer.fit()
    trainer.close()
    assert first.status == "interrupted" and [s for s, _ in list_checkpoints(tmp_path / "b" / "checkpoints")] == [3]
    resumed = train(tiny_config(token_dir, tmp_path / "b", compile=True))
    assert dict(first.losses) | dict(resumed.losses) == dict(straight.losses)
    eager_run = train(tiny_config(token_dir, tmp_path / "c", compile=False))
    for (step_a, a), (step_b, b) in zip(straight.losses, eager_run.losses):
        assert step_a == step_b and abs(a - b) <= 1e-6 * abs(b)


def test_a_failing_compilation_trains_eagerly_after_one_note(token_dir, tmp_path, monkeypatch, farsight_log):
    import farsight.train.compile as compile_module

    def broken(fn, **kwargs):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return run

    monkeypatch.setattr(compile_module.torch, "compile", broken)
    result = train(tiny_config(token_dir, tmp_path / "run", compile=True))
    notes = [line for line in farsight_log.messages if line.startswith("note: torch.compile failed")]
    assert notes == [
        "note: torch.compile failed (RuntimeError: no C++ compiler found); training eagerly "
        "(set train.compile=false to skip compiling)"
    ]
    reference = train(tiny_config(token_dir, tmp_path / "eager", compile=False))
    assert result.losses == reference.losses  # the failed attempt left no trace (grads, RNG)


def _ddp_worker(rank, port, token_dir, out_dir, result_dir):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    trainer = Trainer(tiny_config(token_dir, out_dir, steps=2, compile=True))
    assert trainer.compiled is not None
    result = trainer.fit()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    torch.save({"params": flat, "losses": result.losses}, os.path.join(result_dir, f"rank{rank}.pt"))
    trainer.close()


@pytest.mark.slow  # two processes compiling; DDP and compile are each checked in the default run
def test_ddp_with_compile_keeps_identical_parameters(token_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(token_dir), str(tmp_path / "ddp"), str(tmp_path)), nprocs=2, join=True)
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.equal(a["params"], b["params"]) and a["losses"] == b["losses"]
