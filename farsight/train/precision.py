"""`train.precision`: the dtypes a training run computes in and keeps its weights in.

fp32        everything in float32.
bf16-mixed  float32 weights and AdamW state (the master copy that checkpoints hold); the forward
            pass and the loss run under torch.autocast(bfloat16).
fp16-mixed  the same under float16 autocast, with a dynamic loss scale (torch.amp.GradScaler) so
            that small gradients do not flush to zero; a step whose gradients overflow is
            skipped (its batch is used up, the weights and the lr schedule stay) and the scale halves.
bf16        pure bfloat16: parameters, gradients and AdamW state in bfloat16 (about half the
            memory of the mixed modes; updates smaller than a weight's bf16 rounding step are lost).
auto        see `auto_precision`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.amp.autocast_mode import is_autocast_available

from farsight.errors import ConfigError
from farsight.ops.precision import native_bf16_matmul, software_matmul_dtypes, widened_matmuls


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None = None
    param_dtype: torch.dtype = torch.float32

    @property
    def loss_scaling(self) -> bool:
        return self.autocast_dtype == torch.float16

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """A fresh context for one forward pass and its loss."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def matmuls(self, device: torch.device) -> contextlib.AbstractContextManager:
        """A context for a forward and backward pass: on a CPU without matrix instructions for
        this mode's low-precision dtype its products run as fp32 GEMMs (`widened_matmuls`)."""
        return widened_matmuls(device, self.autocast_dtype, self.param_dtype)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        # under FSDP the gradients are DTensors, whose overflow check is reduced over all ranks
        return torch.amp.GradScaler(device.type) if self.loss_scaling else None

    def cast_parameters(self, model: nn.Module) -> None:
        """Parameters to param_dtype in place (tied parameters stay tied); buffers such as the
        RoPE frequencies and ALiBi slopes keep their own precision."""
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(self.param_dtype)


MODES = {
    "fp32": Precision("fp32"),
    "bf16-mixed": Precision("bf16-mixed", autocast_dtype=torch.bfloat16),
    "fp16-mixed": Precision("fp16-mixed", autocast_dtype=torch.float16),
    "bf16": Precision("bf16", param_dtype=torch.bfloat16),
}

# What to use instead when a device cannot run a mode.
_ALTERNATIVE = {"bf16-mixed": "fp16-mixed", "bf16": "fp16-mixed", "fp16-mixed": "bf16-mixed"}


def auto_precision(device: torch.device) -> str:
    """What train.precision=auto resolves to on `device`.

    CUDA: bf16-mixed on a GPU with native bf16 (Ampere and newer), else fp16-mixed (bf16
    emulated on an older GPU is slower than fp16).
    CPU: bf16-mixed where the CPU has bf16 matmul instructions, else fp32. Measured on a 2-core
    AMD EPYC with AVX512-BF16 (figures and commands in docs/training.md): bf16-mixed trains a
    d_model-256 model 1.8-2.0x (causal) and 1.2x (sliding) faster than fp32 with less memory,
    and after 200 steps of a small model its validation loss is within the seed-to-seed spread
    of fp32's. With the BF16 instructions masked (bf16 emulated on AVX-512) the same step ran
    at 0.6-0.8x of fp32, and on a 2-core AVX2 EPYC (no AVX-512), with bf16 products widened to
    fp32 GEMMs (`widened_matmuls`), at 0.71-0.85x of fp32 (9x slower with torch's own kernels):
    hence fp32 on CPUs without them.
    Other devices (mps): fp32, as before this option existed.
    """
    if device.type == "cuda":
        return "bf16-mixed" if native_bf16_matmul(device) else "fp16-mixed"
    if device.type == "cpu":
        return "bf16-mixed" if native_bf16_matmul(device) else "fp32"
    return "fp32"


def _autocast_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch autocasts a matmul on `device` to `dtype` (an unsupported dtype
    disables autocast with a warning, or raises)."""
    if not is_autocast_available(device.type):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast(device.type, dtype=dtype):
                x = torch.ones(2, 2, device=device)
                return (x @ x).dtype == dtype
        except RuntimeError:
            return False


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The mode train.precision=`name` runs in on `device`; ConfigError if the device cannot."""
    resolved = auto_precision(device) if name == "auto" else name
    mode = MODES[resolved]
    wants_bf16 = torch.bfloat16 in (mode.autocast_dtype, mode.param_dtype)
    if device.type == "cuda" and wants_bf16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision={resolved}: {torch.cuda.get_device_name(device)} does not support bfloat16; "
            f"use train.precision={_ALTERNATIVE[resolved]}"
        )
    if mode.autocast_dtype is not None and not _autocast_runs(device, mode.autocast_dtype):
        raise ConfigError(
            f"train.precision={resolved}: torch {torch.__version__} cannot autocast to {mode.autocast_dtype} "
            f"on {device.type}; use train.precision={_ALTERNATIVE[resolved]} or fp32"
        )
    return mode


def widens_products(precision: Precision, device: torch.device) -> bool:
    """Whether `precision` runs its low-precision products as fp32 GEMMs on `device`
    (`Precision.matmuls` enters `widened_matmuls`)."""
    return bool(software_matmul_dtypes(device).intersection((precision.autocast_dtype, precision.param_dtype)))


def _denormals_flushed() -> bool:
    """Whether this thread flushes denormals (then 1e-39, a denormal, multiplies to 0)."""
    return float(torch.tensor(1e-39, dtype=torch.float32) * 1.0) == 0.0


_THREAD_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|iomp5|omp)[-.\w]*\.so[.\d]*$")


@functools.cache
def _openmp_parallel_entries() -> tuple:
    """GOMP_parallel of every OpenMP runtime mapped into this process (torch's libgomp; Intel's
    and LLVM's runtimes export the same entry point), or () without one (another parallel
    backend, or no /proc/self/maps)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ()
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line.rstrip())})
    except OSError:
        return ()
    entries = []
    for path in paths:
        entry = getattr(ctypes.CDLL(path), "GOMP_parallel", None)
        if entry is not None:
            entry.argtypes, entry.restype = [_THREAD_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
            entries.append(entry)
    return tuple(entries)


def _on_every_cpu_thread(body: Callable[[], None]) -> None:
    """body() on the calling thread and on every thread of torch's OpenMP pool (the threads that
    run torch's CPU kernels, MKL's and oneDNN's among them): a parallel region of
    torch.get_num_threads() threads, which the runtime serves from the same pool as torch's."""
    entries = _openmp_parallel_entries()
    if not entries:
        body()
        return
    # ctypes releases the GIL for the call and takes it in each thread for `body`
    callback = _THREAD_BODY(lambda _data: body())
    for entry in entries:
        entry(callback, None, torch.get_num_threads(), 0)


@contextlib.contextmanager
def flush_denormals(device: torch.device):
    """CPU training with denormal numbers flushed to zero on every thread that computes, each
    put back as found afterwards.

    Softmax probabilities and their gradients between about 1e-45 and 1e-38 (the exponentials of
    scores 87-103 below a row's maximum, which ALiBi produces at long distances) are denormal in
    fp32, and x86 GEMMs take microcode assists on them: the fp32 sliding-window attention's f+b
    ran 2.4x faster with them flushed (0.30 against 0.72 s at B=4, T=4096, H=4, d=64, W=512),
    the BaseLM step of benchmarks/drt.py 1.8x. Values that small change nothing a training run
    can see. bf16 GEMMs (AMX) flush bf16 denormals themselves. Elsewhere (GPUs) a null context.

    The flag is a register of each thread (torch.set_flush_denormal sets the caller's only), so
    it is set on the caller and on each thread of torch's OpenMP pool, which runs most of a
    kernel's work (all but 1/threads of it). Without an OpenMP runtime to reach (another
    parallel backend) only the caller's is set.
    """
    if device.type != "cpu":
        yield
        return
    unflushed: set[int] = set()

    def flush() -> None:
        if not _denormals_flushed():
            unflushed.add(threading.get_native_id())
            torch.set_flush_denormal(True)

    def restore() -> None:
        if threading.get_native_id() in unflushed:
            torch.set_flush_denormal(False)

    _on_every_cpu_thread(flush)
    try:
        yield
    finally:
        if unflushed:
            _on_every_cpu_thread(restore)


def software_dtype_reason(dtype: torch.dtype | None, device: torch.device) -> str | None:
    """Why `device` has no matrix instructions for `dtype`, or None (fp32, GPUs, native bf16).

    Products in such a dtype run as fp32 GEMMs (`widened_matmuls`): the dtype's rounding at
    fp32's speed, no faster. Without that, torch's software kernels ran a demo DRT step 12x slower
    than fp32 in fp16 on an AVX512-BF16 EPYC and a passkey-drt step 9x slower in bf16 on an AVX2 one.
    """
    if dtype not in software_matmul_dtypes(device):
        return None
    if dtype == torch.float16:
        return "this CPU has no fp16 matrix instructions (AVX512-FP16, AMX-FP16)"
    return "this CPU has no bf16 matrix instructions (AVX512-BF16, AMX)"


def precision_note(precision: Precision, device: torch.device) -> str | None:
    """A one-line note for a mode whose low-precision products `device` cannot run in hardware
    (`software_dtype_reason`): they run as fp32 GEMMs, and the note names the fast mode there."""
    for dtype in (precision.autocast_dtype, precision.param_dtype):
        reason = software_dtype_reason(dtype, device)
        if reason is not None:
            fast = "bf16-mixed" if native_bf16_matmul(device) else "fp32"
            return (
                f"note: {reason}: {precision.name} runs its matrix products as fp32 GEMMs (its rounding, "
                f"fp32's speed at best); {fast} is the fast mode on this CPU"
            )
    return None
