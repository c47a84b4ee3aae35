"""Backend choice shared by the ops (`backend=` of gca, castle_attention, sliding_window_attention).

`resolve_backend` checks the name against the op's choices, turns "auto" into a concrete
backend and fails with one clear line when a forced backend cannot run for lack of a package.
"auto" means: the Triton kernels for CUDA tensors (not fp64) when triton is installed, else the
PyTorch path "torch"; an op whose fast path is not Triton passes its own rule. Triton is only
looked up here, never imported, so that farsight imports without it.

The environment variable FARSIGHT_TRITON=0 makes "auto" pass over farsight's Triton kernels
(GCA, CASTLE) for the PyTorch paths, e.g. where a Triton release fails to compile them; an
explicit backend="triton" still runs them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from farsight.errors import InputError, MissingDependencyError


class BackendUnavailableError(MissingDependencyError, RuntimeError):
    """A forced backend needs a package (or version) that is missing. Also a RuntimeError, the
    type these errors had before, so that `except RuntimeError` keeps catching them."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_enabled() -> bool:
    """False when the environment sets FARSIGHT_TRITON=0: "auto" then never picks a Triton kernel.
    Unset, empty or 1 leave it on; any other value is refused (FARSIGHT_TRITON=false must not
    quietly mean on)."""
    value = os.environ.get("FARSIGHT_TRITON", "")
    if value not in ("", "0", "1"):
        raise InputError(f"FARSIGHT_TRITON must be 0 (no Triton kernels for backend='auto') or 1, got {value!r}")
    return value != "0"


def triton_or_torch(x: torch.Tensor) -> str:
    """The default "auto" rule: "triton" for CUDA tensors (fp32/fp16/bf16) when triton is installed
    and FARSIGHT_TRITON is not 0."""
    use_triton = x.is_cuda and x.dtype != torch.float64 and triton_enabled() and triton_available()
    return "triton" if use_triton else "torch"


def resolve_backend(
    backend: str,
    x: torch.Tensor,
    allowed: tuple[str, ...],
    auto: Callable[[torch.Tensor], str] = triton_or_torch,
) -> str:
    """The backend to run for the requested `backend` and inputs like `x`.

    `allowed` lists the op's choices ("auto" included); `auto(x)` picks one for "auto". Raises
    InputError for a name not in `allowed` and BackendUnavailableError for "triton" without
    the triton package.
    """
    if backend not in allowed:
        raise InputError(f"backend must be one of {allowed}, got {backend!r}")
    if backend == "auto":
        return auto(x)
    if backend == "triton" and not triton_available():
        raise BackendUnavailableError(
            'backend="triton" needs the triton package; install it (pip install "farsight[triton]") '
            'or use backend="torch"'
        )
    return backend
