"""Every Triton kernel compiles for a Hopper GPU (sm_90) on this machine, no GPU needed, with its
float scalars typed both as Triton's launcher passes a Python float (fp32) and as torch.compile's
Inductor does (fp64): a kernel whose loop-carried values turned fp64 under Inductor failed to
compile inside a compiled model."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
def test_kernels_compile_for_sm90(float_type):
    # the kernels are compiled, not interpreted: a fresh process without TRITON_INTERPRET
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "benchmarks/kernel_resources.py", "--dims", "64", "--first-launch"]
    done = subprocess.run(
        [*command, "--float-type", float_type], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{float_type} scalars" in done.stdout
    assert done.stdout.count(" 64 ") >= 8, done.stdout  # a row per kernel at d=64
