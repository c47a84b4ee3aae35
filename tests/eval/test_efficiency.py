"""The training step the benchmarks time (farsight.eval.efficiency.training_step)."""

import pytest
import torch

from farsight.eval.efficiency import training_step
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
