"""Comparison for low-precision results: relative RMS error against a higher-precision reference.

Elementwise tolerances either fail on the few entries that round badly or, set loose enough for
those, miss a systematic error. The relative RMS error rms(got - ref) / rms(ref) measures the
whole tensor against its own scale, which is how mixed-precision kernels are usually judged.
"""

from __future__ import annotations

import math

import torch

# rms(got - ref) / rms(ref) allowed for results computed from inputs rounded to (or running in) a dtype.
RMS_RATIO = {torch.bfloat16: 0.02, torch.float16: 0.005}


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def assert_close_rms(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    """Assert `got` is finite, has `ref`'s shape and rms(got - ref) <= ratio * rms(ref).

    An all-zero `ref` (an op that must give exact zeros, e.g. with nothing retrieved) needs an
    all-zero `got`.
    """
    assert got.shape == ref.shape, f"{name}: shape {list(got.shape)}, expected {list(ref.shape)}"
    assert bool(torch.isfinite(got).all()), f"{name}: non-finite values"
    error, scale = rms(got.double() - ref.double()), rms(ref)
    relative = error / scale if scale else (math.inf if error else 0.0)
    assert relative <= ratio, f"{name}: relative RMS error {relative:.3g} > {ratio} (rms of the reference {scale:.3g})"
