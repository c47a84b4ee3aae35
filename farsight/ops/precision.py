"""Mixed precision shared by the ops (SPEC 6, precision).

`autocast_inputs` is what the entry points (`gca`, `castle_attention`, `castle_prefill`,
`castle_decode`, the CASTLE reference wrappers, `sliding_window_attention`) do under
`torch.autocast`: they take the dtype mixes autocast produces (bf16 q from a linear next to an
fp32 k from a norm, ...), cast their main inputs to the autocast dtype and run the op with
autocast off. Inside, the ops keep their own fp32 statistics and accumulators; with autocast on,
every matmul would be re-cast to bf16/fp16 (mixing dtypes in in-place products and rounding the
statistics). The output then has the autocast dtype, and the casts carry each input's gradient
back in that input's own dtype.

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
