import json
import math

import pytest
import torch
from safetensors.torch import load_file

from farsight.config import ConfigError
from farsight.ops import precision as ops_precision
from farsight.train import precision as precision_module
from farsight.train.checkpoint import load_trainer_state
from farsight.train.precision import MODES, auto_precision, precision_note, resolve_precision
from farsight.train.trainer import Trainer, TrainingDiverged, train
from tests.train.conftest import tiny_config

PRECISIONS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16"]
MODELS = {
    "causal": {"type": "transformer", "d_model": 32, "n_layers": 2, "n_heads": 2},
    "sliding": {
        "type": "transformer",
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "attention": "sliding",
        "window": 16,
    },
    "castle": {"type": "transformer", "d_model": 32, "n_layers": 2, "n_heads": 2, "attention": "castle"},
    "castle-swl": {
        "type": "transformer",
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "attention": "castle-swl",
        "lookahead_window": 8,
    },
    "drt": {"type": "drt", "d_model": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8, "window": 16},
}


def train_kind(token_dir, out_dir, kind, precision, farsight_log):
    config = tiny_config(token_dir, out_dir, steps=8, precision=precision)
    config.model = dict(MODELS[kind])
    result = train(config)
    losses = [loss for _, loss in result.losses]
    assert all(math.isfinite(loss) for loss in losses) and len(losses) == 8
    assert losses[-1] < losses[0] - 0.3, losses
    assert f"training in {precision} on cpu" in farsight_log.text
    records = [r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(records) == 8 and all(r["precision"] == precision for r in records)
    assert load_trainer_state(result.checkpoint)["precision"] == precision
    weights = load_file(result.checkpoint / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16 if precision == "bf16" else torch.float32}
    return records


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["causal", "sliding"])
def test_causal_and_sliding_train_in_every_precision(token_dir, tmp_path, farsight_log, kind, precision):
    records = train_kind(token_dir, tmp_path / "run", kind, precision, farsight_log)
    assert ({"loss_scale", "skipped_steps"} <= set(records[-1])) == (precision == "fp16-mixed")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["castle", "castle-swl", "drt"])
def test_castle_and_drt_train_in_every_precision(token_dir, tmp_path, farsight_log, kind, precision):
    train_kind(token_dir, tmp_path / "run", kind, precision, farsight_log)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_parameters_and_optimizer_state_keep_their_precision(token_dir, tmp_path, precision):
    trainer = Trainer(tiny_config(token_dir, tmp_path / "run", steps=2, precision=precision))
    dtypes = set()
    trainer.model.blocks[0].mlp.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    trainer.fit()
    kept = torch.bfloat16 if precision == "bf16" else torch.float32
    computed = {
        "fp32": torch.float32,
        "bf16-mixed": torch.bfloat16,
        "fp16-mixed": torch.float16,
        "bf16": torch.bfloat16,
    }
    assert dtypes == {computed[precision]}
    assert {p.dtype for p in trainer.model.parameters()} == {kept}
    moments = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and {m.dtype for m in moments} == {kept}
    assert (trainer.scaler is not None) == (precision == "fp16-mixed")
    assert not list(trainer.model.blocks[0].attn.rotary.buffers())  # RoPE frequencies are never cast


def test_unknown_precision_lists_the_choices(token_dir, tmp_path):
    with pytest.raises(
        ConfigError, match=r"train.precision must be one of auto, fp32, bf16-mixed, fp16-mixed, bf16, got 'fp8'"
    ):
        tiny_config(token_dir, tmp_path / "run", precision="fp8")


def test_bf16_on_a_gpu_without_bf16_names_fp16_mixed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    for name in ("bf16-mixed", "bf16"):
        message = rf"train.precision={name}: Tesla V100 does not support bfloat16; use train.precision=fp16-mixed"
        with pytest.raises(ConfigError, match=message):
            resolve_precision(name, torch.device("cuda", 0))


def test_fp16_mixed_without_cpu_fp16_autocast_names_bf16_mixed(monkeypatch):
    assert precision_module._autocast_runs(torch.device("cpu"), torch.bfloat16)
    assert not precision_module._autocast_runs(torch.device("cpu"), torch.float64)  # autocast disables itself
    monkeypatch.setattr(precision_module, "_autocast_runs", lambda device, dtype: dtype != torch.float16)
    with pytest.raises(
        ConfigError, match=r"cannot autocast to torch.float16 on cpu; use train.precision=bf16-mixed or fp32"
    ):
        resolve_precision("fp16-mixed", torch.device("cpu"))
    assert resolve_precision("bf16-mixed", torch.device("cpu")).name == "bf16-mixed"


def test_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: True)
    assert auto_precision(torch.device("cpu")) == "bf16-mixed"
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: False)
    assert auto_precision(torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cpu")).name == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert auto_precision(torch.device("cuda", 0)) == "fp16-mixed"  # only emulated bf16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_precision(torch.device("cuda", 0)) == "bf16-mixed"
    assert auto_precision(torch.device("mps")) == "fp32"


def test_fp16_overflow_skips_the_update_and_the_schedule(token_dir, tmp_path):
    trainer = Trainer(tiny_config(token_dir, tmp_path / "run", precision="fp16-mixed"))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    loss, grad_norm, _ = trainer._train_step()
    assert math.isfinite(loss) and not math.isfinite(grad_norm)
    assert trainer.step == 1 and trainer.skipped_steps == 1 and trainer.scaler.get_scale() == 2.0**39
    assert trainer.scheduler.last_epoch == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_fp16_gradients_that_overflow_at_every_scale_stop_the_run(token_dir, tmp_path):
    trainer = Trainer(tiny_config(token_dir, tmp_path / "run", precision="fp16-mixed"))
    trainer.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is nan at step 4.*loss scale is down to 0.5"):
        trainer.fit()
    assert trainer.skipped_steps == 3


def test_fp16_on_a_cpu_gets_a_note_on_speed(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(ops_precision, "cpu_has_native_fp16", lambda: False)
    note = precision_note(MODES["fp16-mixed"], cpu)
    assert note.startswith(
        "note: this CPU has no fp16 matrix instructions (AVX512-FP16, AMX-FP16): fp16-mixed runs its matrix products as fp32 GEMMs"
    )
    assert note.endswith("bf16-mixed is the fast mode on this CPU")
    assert precision_note(MODES["bf16-mixed"], cpu) is None
    assert precision_note(MODES["fp32"], cpu) is None


def test_bf16_on_a_cpu_without_bf16_instructions_gets_a_note_on_speed(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(ops_precision, "cpu_has_native_fp16", lambda: False)
    for name in ("bf16-mixed", "bf16", "fp16-mixed"):
        note = precision_note(MODES[name], cpu)
        assert f": {name} runs its matrix products as fp32 GEMMs" in note and note.endswith(
            "fp32 is the fast mode on this CPU"
        )
    assert "no bf16 matrix instructions" in precision_note(MODES["bf16-mixed"], cpu)
    assert precision_note(MODES["fp32"], cpu) is None
    assert precision_note(MODES["bf16-mixed"], torch.device("cuda", 0)) is None


@pytest.mark.parametrize("native", [False, True])
def test_low_precision_training_widens_the_products_the_cpu_lacks(
    native, token_dir, tmp_path, monkeypatch, widened_ops
):
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: native)
    widened = widened_ops
    trainer = Trainer(tiny_config(token_dir, tmp_path / "run", precision="bf16-mixed"))
    loss, grad_norm, _ = trainer._train_step()
    assert math.isfinite(loss) and math.isfinite(grad_norm)
    assert trainer.evaluate()["val_loss"] > 0
    if native:
        assert not widened
    else:
        # the linears forward and backward, SDPA's backward, the evaluation's forward
        assert {"mm", "_scaled_dot_product_flash_attention_for_cpu_backward"} <= set(widened) and len(widened) > 20


def test_native_bf16_matmul_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: True)
    assert ops_precision.native_bf16_matmul(torch.device("cpu"))
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: False)
    assert not ops_precision.native_bf16_matmul(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not ops_precision.native_bf16_matmul(torch.device("cuda", 0))  # emulated only
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert ops_precision.native_bf16_matmul(torch.device("cuda", 0))
    assert not ops_precision.native_bf16_matmul(torch.device("meta"))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _denormals_kept(x: torch.Tensor) -> int:
    """How many of x's denormals survive a multiplication that torch splits over its threads."""
    return int(((x * 1.0) != 0).sum())


def test_flush_denormals_reaches_every_thread_and_puts_each_back(two_threads):
    cpu = torch.device("cpu")
    denormals = torch.full((1 << 20,), 1e-39)  # many grains: every thread of the pool takes some
    assert _denormals_kept(denormals) == denormals.numel()
    with precision_module.flush_denormals(cpu):
        assert _denormals_kept(denormals) == 0
        with precision_module.flush_denormals(cpu):  # nested: nothing to set, nothing to put back
            assert _denormals_kept(denormals) == 0
        assert _denormals_kept(denormals) == 0
        assert float(torch.sum(denormals)) == 0.0  # a reduction, split over the threads too
    assert _denormals_kept(denormals) == denormals.numel()


def test_flush_denormals_without_an_openmp_runtime_sets_the_caller(monkeypatch):
    monkeypatch.setattr(precision_module, "_openmp_parallel_entries", lambda: ())
    with precision_module.flush_denormals(torch.device("cpu")):
        assert float(torch.tensor(1e-39) * 1.0) == 0.0
    assert float(torch.tensor(1e-39) * 1.0) != 0.0
