"""farsight's custom ops (torch.library): the CPU attention kernels that torch.compile keeps as
they are (sliding window, GCA, CASTLE), and what the benchmarks need to see inside them.

A custom op is opaque to torch.compile, so a compiled model runs the same ATen kernels as an
eager one, and to dispatch modes such as torch's FlopCounterMode, which `count_flops` sees
through by running each op's kernel again under a counter of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

# name -> the Python kernel behind torch.ops.farsight.<name>
KERNELS: dict[str, Callable[..., Any]] = {}


def custom_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """`torch.library.custom_op("farsight::<name>", mutates_args=())`, with the kernel run with
    autocast off (a custom op's kernel sees its caller's autocast state, and the kernels cast
    their operands themselves) and recorded in KERNELS."""

    def register(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def kernel(*args: Any, **kwargs: Any) -> Any:
            device = next(x.device.type for x in args if isinstance(x, torch.Tensor))
            if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                with torch.autocast(device, enabled=False):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        KERNELS[name] = kernel
        return torch.library.custom_op(f"farsight::{name}", mutates_args=())(kernel)

    return register


def _sdpa_flops(query: torch.Tensor, key: torch.Tensor, products: int, causal: bool) -> int:
    """`products` matrix products of [L, E] x [E, S] per batch and head, over the causal pairs
    L(L+1)/2 for a causal call (what a flash kernel computes) instead of L * S."""
    *batch, length, dim = query.shape
    pairs = length * (length + 1) // 2 if causal and length == key.shape[-2] else length * key.shape[-2]
    return products * 2 * dim * pairs * math.prod(batch)


def count_flops(fn: Callable[[], Any]) -> int:
    """Matrix-product FLOPs of `fn()` by torch's FlopCounterMode, seeing inside farsight's custom
    ops and counting the CPU flash-attention kernels of F.scaled_dot_product_attention (which
    the counter has no formula for) as 2 products forward and 4 backward over the attended
    pairs (L(L+1)/2 with is_causal). Runs `fn` once (and each custom op's kernel twice)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten

    def inside(kernel: Callable[..., Any]) -> Callable[..., int]:
        def flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            with FlopCounterMode(display=False) as counter:
                kernel(*args, **kwargs)
            return counter.get_total_flops()

        return flops

    def sdpa_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
        causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
        return _sdpa_flops(query, key, 2, bool(causal))

    def sdpa_backward(grad_out, query, key, value, out, logsumexp, *args, out_val=None, **kwargs) -> int:
        causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
        return _sdpa_flops(query, key, 4, bool(causal))

    # keyed by overload packet; _get_raw: the formulas take the tensors, not their shapes
    mapping: dict[Any, Callable[..., int]] = {getattr(torch.ops.farsight, n): inside(k) for n, k in KERNELS.items()}
    mapping[aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_forward
    mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = sdpa_backward
    for formula in mapping.values():
        formula._get_raw = True
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops()
