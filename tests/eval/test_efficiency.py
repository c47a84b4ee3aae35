"""The training step the benchmarks time (farsight.eval.efficiency.training_step) and the
interleaved timing their ratio targets use (time_interleaved, paired_ratio)."""

import pytest
import torch

from farsight.eval import efficiency
from farsight.eval.efficiency import paired_ratio, time_interleaved, training_step
from farsight.models import DRTConfig, DRTForCausalLM
from farsight.ops import precision as ops_precision


def _model() -> DRTForCausalLM:
    torch.manual_seed(0)
    config = DRTConfig(
        vocab_size=40, d_model=16, n_layers=2, n_heads=2, chunk_size=4, window=8, top_k=2, encoder_layers=1
    )
    return DRTForCausalLM(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "precision, param_dtype, autocast_dtype",
    [
        ("fp32", torch.float32, None),
        ("bf16-mixed", torch.float32, torch.bfloat16),
        ("bf16", torch.bfloat16, None),
        ("fp16-mixed", torch.float32, torch.float16),
    ],
)
def test_a_step_trains_every_parameter_in_the_trainers_precision(precision, param_dtype, autocast_dtype, monkeypatch):
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    step = training_step(model, _ids(), precision)
    step()
    step()
    assert seen == [autocast_dtype, autocast_dtype]
    moved = set()
    for name, param in model.named_parameters():
        assert param.dtype == param_dtype, name
        assert torch.isfinite(param).all(), name
        if not torch.equal(param.float(), before[name].float()):
            moved.add(name)
    # in pure bf16 a step of lr 1e-4 is below the resolution of weights near 1 (the norms)
    assert moved == set(before) if param_dtype == torch.float32 else "embed.weight" in moved


@pytest.mark.parametrize("widen", [True, False])
def test_widening_follows_the_trainer_unless_turned_off(widen, monkeypatch, widened_ops):
    monkeypatch.setattr(ops_precision, "cpu_has_native_bf16", lambda: False)
    training_step(_model(), _ids(), "bf16-mixed", widen=widen)()
    assert ("mm" in widened_ops) == widen


def test_interleaved_rounds_rotate_the_order_and_time_each_call(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(efficiency.time, "perf_counter", lambda: clock[0])
    calls = []

    def work(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            clock[0] += seconds

        return run

    times = time_interleaved({"a": work("a", 1.0), "b": work("b", 3.0), "c": work("c", 0.5)}, warmup=1, rounds=4)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert times == {"a": [1.0] * 4, "b": [3.0] * 4, "c": [0.5] * 4}


def test_paired_ratio_is_taken_round_by_round():
    # Both slow down together in round 2: the paired ratio stays 2, the medians' ratio would not.
    assert paired_ratio([2.0, 8.0, 2.2], [1.0, 4.0, 1.0]) == {"median": 2.0, "min": 2.0, "max": 2.2}


@pytest.mark.parametrize("a, b", [([], []), ([1.0], [1.0, 2.0])])
def test_paired_ratio_refuses_lists_that_do_not_pair(a, b):
    with pytest.raises(ValueError, match="equally long, non-empty"):
        paired_ratio(a, b)


def test_interleaved_refuses_zero_rounds():
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        time_interleaved({"a": lambda: None}, rounds=0)
