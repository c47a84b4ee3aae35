"""Mixed precision shared by the ops (SPEC 6, precision).

`autocast_inputs` is what the entry points (`gca`, `castle_attention`, `castle_prefill`,
`castle_decode`, the CASTLE reference wrappers, `sliding_window_attention`) do under
`torch.autocast`: they take the dtype mixes autocast produces (bf16 q from a linear next to an
fp32 k from a norm, ...), cast their main inputs to the autocast dtype and run the op with
autocast off. Inside, the ops keep their own fp32 statistics and accumulators; with autocast on,
every matmul would be re-cast to bf16/fp16 (mixing dtypes in in-place products and rounding the
statistics). The output then has the autocast dtype, and the casts carry each input's gradient
back in that input's own dtype.

`native_bf16_matmul` says whether bf16 matrix products run in hardware on a device: fast paths
that trade fp32 GEMMs for bf16 ones (the retrieval screen) pay off only there.

`amp_function` applies `torch.amp.custom_fwd` / `custom_bwd` to an autograd Function for the
device type of its inputs, so that its backward runs under the forward's autocast state (off)
even when `.backward()` is called inside an autocast region.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


def _castable(x: object) -> bool:
    # Autocast's own rule: it casts floating tensors and leaves fp64 (and everything else) alone.
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


@contextlib.contextmanager
def autocast_inputs(*inputs: object) -> Iterator[tuple]:
    """Yield `inputs`, cast to the autocast dtype under autocast, and run the body with it off.

    The device type is the first tensor's; autocast is looked up for it alone (a CUDA autocast
    region does not touch CPU inputs). Only floating tensors other than fp64 are cast; anything
    else (fp64, integer tensors, non-tensors) passes through unchanged for the caller's checks
    to reject with their usual messages. Outside autocast this yields `inputs` as they are, so
    mixed dtypes still reach those checks.
    """
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    device_type = None if first is None else first.device.type
    # is_autocast_enabled raises for device types without autocast (meta).
    usable = device_type is not None and torch.amp.is_autocast_available(device_type)
    if not (usable and torch.is_autocast_enabled(device_type)):
        yield inputs
        return
    dtype = torch.get_autocast_dtype(device_type)
    cast = tuple(x.to(dtype) if _castable(x) else x for x in inputs)
    with torch.autocast(device_type, enabled=False):
        yield cast


@functools.cache
def amp_function(function: type[torch.autograd.Function], device_type: str) -> type[torch.autograd.Function]:
    """`function` with its forward under `custom_fwd` and its backward under `custom_bwd` for `device_type`.

    Both decorators take one fixed device type: custom_fwd records that device type's autocast
    state on ctx and custom_bwd restores it around the backward. A Function whose inputs may be
    on any device (the PyTorch paths; the Triton ones run on CUDA, or on CPU under the
    interpreter) cannot pick one type, and stacking decorators for two types would let one
    overwrite the other's ctx fields. So each device type gets its own subclass, made on first
    use: call `amp_function(F, x.device.type).apply(...)`. Device types without autocast (meta)
    get `function` itself.
    """
    if not torch.amp.is_autocast_available(device_type):
        return function
    return type(
        f"{function.__name__}_{device_type}",
        (function,),
        {
            "forward": staticmethod(torch.amp.custom_fwd(function.forward, device_type=device_type)),
            "backward": staticmethod(torch.amp.custom_bwd(function.backward, device_type=device_type)),
        },
    )


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 (x86) or the BF16 extension (Arm): bf16 matmuls in hardware."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # absent from older torch: assume none
    caps = get_capabilities() if get_capabilities is not None else {}
    return any(caps.get(flag, False) for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 matrix products run in hardware on `device` (and so beat fp32 ones).

    CUDA GPUs with native bf16 (Ampere and newer) and CPUs with bf16 instructions do; elsewhere
    torch emulates them. On a 2-core AVX2 EPYC (no AVX-512) a bf16 GEMM ran at 1.3 GFLOP/s
    against 84-158 GFLOP/s in fp32, where an AVX512-BF16 EPYC runs bf16 4.5x faster than fp32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()
