"""Mixed precision shared by the ops (docs/design.md §6).

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
`widened_matmuls` runs the bf16/fp16 matrix products of CPU tensors as fp32 GEMMs where the CPU
has no instructions for them (torch's software loop ran a GEMM 65-200x and a training step
12-25x slower than fp32): the trainer, the command line, the Hugging Face wrapper's inference
and the lm-eval adapter enter it for low-precision work.

`amp_function` applies `torch.amp.custom_fwd` / `custom_bwd` to an autograd Function for the
device type of its inputs, so that its backward runs under the forward's autocast state (off)
even when `.backward()` is called inside an autocast region.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


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
    """AVX512-BF16 or AMX-BF16 (x86) or the BF16 extension (Arm): bf16 matmuls in hardware.

    An x86 CPU's instructions count only where oneDNN, which runs torch's bf16 products there,
    may use them (`ONEDNN_MAX_CPU_ISA` at AVX512_CORE_BF16 or above)."""
    return _cpu_has_any("avx512_bf16", "amx_bf16", "bf16") and _onednn_isa_allows("AVX512_CORE_BF16")


# oneDNN's x86 instruction-set levels, lowest first (its ONEDNN_MAX_CPU_ISA values; AVX10_1_512
# is AVX512_CORE_FP16 and AVX10_1_512_AMX* the AVX512_CORE_AMX* levels under their newer names)
_ONEDNN_ISA_LEVELS = (
    ("SSE41",),
    ("AVX",),
    ("AVX2",),
    ("AVX2_VNNI",),
    ("AVX2_VNNI_2",),
    ("AVX512_CORE",),
    ("AVX512_CORE_VNNI",),
    ("AVX512_CORE_BF16",),
    ("AVX512_CORE_FP16", "AVX10_1_512"),
    ("AVX512_CORE_AMX", "AVX10_1_512_AMX"),
    ("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16"),
)


def _onednn_isa_level(name: str) -> int | None:
    name = name.strip().upper()
    return next((level for level, names in enumerate(_ONEDNN_ISA_LEVELS) if name in names), None)


def _onednn_isa_allows(needed: str) -> bool:
    """Whether oneDNN may use the `needed` level: its cap (ONEDNN_MAX_CPU_ISA, or the older
    DNNL_MAX_CPU_ISA) is unset, ALL/DEFAULT, a name this list lacks, or at least `needed`."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if cap is None or platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    level = _onednn_isa_level(cap)
    return level is None or level >= _onednn_isa_level(needed)


def _cpu_has_any(*flags: str) -> bool:
    """Whether torch reports any of these CPU capability flags."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # absent from older torch: assume none
    caps = get_capabilities() if get_capabilities is not None else {}
    return any(caps.get(flag, False) for flag in flags)


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 matrix products run in hardware on `device` (and so beat fp32 ones).

    CUDA GPUs with native bf16 (Ampere and newer) and CPUs with bf16 instructions do; elsewhere
    torch emulates them. On a 2-core AVX2 EPYC (no AVX-512) a bf16 GEMM ran at 1.3 GFLOP/s
    against 84-158 GFLOP/s in fp32, where an AVX512-BF16 EPYC runs bf16 4.5x faster than fp32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_native_bf16()


@functools.cache
def cpu_has_native_fp16() -> bool:
    """AVX512-FP16 or AMX-FP16 (x86): fp16 matmuls in hardware (most x86 CPUs have neither), where
    `ONEDNN_MAX_CPU_ISA` lets oneDNN use them (AVX512_CORE_FP16 or above)."""
    return _cpu_has_any("avx512_fp16", "amx_fp16") and _onednn_isa_allows("AVX512_CORE_FP16")


def software_matmul_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The low-precision dtypes whose matrix products `device` runs in software: on a CPU, bf16
    unless `cpu_has_native_bf16` and fp16 unless `cpu_has_native_fp16`; none elsewhere."""
    if device.type != "cpu":
        return frozenset()
    native = {torch.bfloat16: cpu_has_native_bf16(), torch.float16: cpu_has_native_fp16()}
    return frozenset(dtype for dtype, has in native.items() if not has)


_aten = torch.ops.aten
# The products `WidenedMatmuls` takes over, each with the argument positions that stay fp32
# next to low-precision ones (SDPA's logsumexp). With autograd on, linear, matmul and einsum
# decompose into mm / addmm / bmm before a dispatch mode sees them; under torch.inference_mode
# (farsight's sessions) they arrive whole, hence their own entries.
# Every output of these ops has the low dtype (an op with an fp32 output, such as SDPA's forward,
# would need its own rule; that forward computes in fp32 inside anyway, its backward does not).
# out= and in-place forms, dot and addbmm are left to torch: farsight's models do not use them
# on low-precision CPU tensors.
_WIDENED_OPS: dict[object, tuple[int, ...]] = {
    _aten.mm.default: (),
    _aten.addmm.default: (),
    _aten.bmm.default: (),
    _aten.baddbmm.default: (),
    _aten.mv.default: (),
    _aten.addmv.default: (),
    _aten.linear.default: (),
    _aten.matmul.default: (),
    _aten.einsum.default: (),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (5,),
}


class WidenedMatmuls(TorchDispatchMode):
    """Matrix products of CPU tensors in `dtypes` computed as fp32 GEMMs and rounded back.

    Widening bf16/fp16 to fp32 is exact and an fp32 GEMM accumulates in fp32 as the hardware
    low-precision kernels do, so the result is the one a native bf16/fp16 GEMM gives up to the
    order of its fp32 sums, rounded to the input dtype once; the speed is fp32's. On a 2-core
    AVX2 EPYC torch's bf16 GEMM ran at 0.8-1.3 GFLOP/s against 84-158 GFLOP/s in fp32.

    Only products whose tensors are all on the CPU and all of one dtype in `dtypes` (bar the
    fp32 positions of `_WIDENED_OPS`) are taken over: mixed dtypes reach torch's own kernel and
    its error. While the mode is active every aten call passes through this Python method (about
    13 microseconds more per op measured on that EPYC), and the first call in a process imports
    torch's compiler stack (about 2 s), so enter it only around low-precision work
    (`widened_matmuls`).
    """

    def __init__(self, dtypes: frozenset[torch.dtype]):
        super().__init__()
        self.dtypes = dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fp32_positions = _WIDENED_OPS.get(func)
        if fp32_positions is not None:
            dtype = self._low_dtype(args, kwargs, fp32_positions)
            if dtype is not None:
                return _widened_call(func, dtype, args, kwargs)
        return func(*args, **kwargs)

    def _low_dtype(self, args: tuple, kwargs: dict, fp32_positions: tuple[int, ...]) -> torch.dtype | None:
        """The one dtype in `self.dtypes` of the call's floating CPU tensors, or None."""
        # (top-level argument position, tensor), einsum's operands being one list argument
        tensors = [(i, x) for i, arg in enumerate(args) for x in tree_leaves(arg) if isinstance(x, torch.Tensor)]
        tensors += [(None, x) for x in tree_leaves(kwargs) if isinstance(x, torch.Tensor)]
        floating = [(i, x) for i, x in tensors if x.is_floating_point()]
        if not floating or any(x.device.type != "cpu" for _, x in tensors):
            return None
        dtype = floating[0][1].dtype
        if dtype not in self.dtypes:
            return None
        if all(x.dtype == dtype or (i in fp32_positions and x.dtype == torch.float32) for i, x in floating):
            return dtype
        return None


def _widened_call(func, dtype: torch.dtype, args: tuple, kwargs: dict):
    """`func` on the `dtype` tensors of args / kwargs widened to fp32, its outputs rounded to `dtype`."""

    def widen(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == dtype else x

    out = func(*tree_map(widen, args), **tree_map(widen, kwargs))
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) else x, out)


def widened_matmuls(device: torch.device, *dtypes: torch.dtype | None) -> contextlib.AbstractContextManager:
    """A `WidenedMatmuls` context for those of `dtypes` that `device` multiplies in software,
    else a null context (fp32 work, GPUs and CPUs with the instructions pay nothing)."""
    slow = software_matmul_dtypes(device).intersection(dtypes)
    return WidenedMatmuls(slow) if slow else contextlib.nullcontext()
