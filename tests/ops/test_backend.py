"""The "auto" backend rule shared by the ops, and FARSIGHT_TRITON=0 turning Triton off for it."""

from types import SimpleNamespace

import pytest
import torch

from farsight.errors import InputError
from farsight.ops import backend


def cuda_like(dtype=torch.bfloat16):
    """Only is_cuda and dtype are read by the rule: a stand-in for a CUDA tensor on a CPU host."""
    return SimpleNamespace(is_cuda=True, dtype=dtype)


@pytest.fixture
def triton_installed(monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: True)


def test_auto_picks_triton_for_cuda_tensors(triton_installed, monkeypatch):
    monkeypatch.delenv("FARSIGHT_TRITON", raising=False)
    assert backend.triton_or_torch(cuda_like()) == "triton"
    assert backend.triton_or_torch(cuda_like(torch.float64)) == "torch"
    assert backend.triton_or_torch(torch.zeros(1)) == "torch"


@pytest.mark.parametrize("value, expected", [("0", "torch"), ("1", "triton"), ("", "triton")])
def test_farsight_triton_env_switches_auto(triton_installed, monkeypatch, value, expected):
    monkeypatch.setenv("FARSIGHT_TRITON", value)
    assert backend.resolve_backend("auto", cuda_like(), ("auto", "torch", "triton")) == expected


def test_explicit_triton_ignores_the_env(triton_installed, monkeypatch):
    monkeypatch.setenv("FARSIGHT_TRITON", "0")
    assert backend.resolve_backend("triton", cuda_like(), ("auto", "torch", "triton")) == "triton"


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_farsight_triton_refuses_other_values(triton_installed, monkeypatch, value):
    monkeypatch.setenv("FARSIGHT_TRITON", value)
    with pytest.raises(InputError, match=f"FARSIGHT_TRITON must be 0 .* or 1, got '{value}'"):
        backend.resolve_backend("auto", cuda_like(), ("auto", "torch", "triton"))
