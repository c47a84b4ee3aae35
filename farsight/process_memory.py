"""This process's resident memory: current and peak RSS, resetting the peak, trimming the heap,
and the malloc settings under which CPU tensors are reused instead of page-faulted in again.

CPU tensors have no allocator statistics in PyTorch, so memory on CPU is read from the OS.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import psutil

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def current_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """High-water mark of the resident set size since start or since `reset_peak_rss()`."""
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Lower the high-water mark to the current RSS (Linux: clear_refs 5); False where unsupported."""
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _load_glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl)
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_GLIBC = _load_glibc()
# mallopt parameters (malloc.h) and the values tune_malloc sets
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1
TUNE_MALLOC_ENV = "FARSIGHT_DEFAULT_MALLOC"


def release_freed_memory() -> None:
    """Give the memory that glibc keeps after freed CPU tensors back to the OS.

    Tensors served from the heap (always under `tune_malloc`; under glibc's defaults once its
    mmap threshold has risen past a freed block's size) leave it fragmented, and it does not
    shrink by itself: a CPU training run of the demo DRT once grew by about 5 MB per step, to
    24 GB and an out-of-memory kill at step 2740. Trimming every log interval keeps it near its
    working set (about 450 MB there).
    """
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


def tune_malloc() -> bool:
    """Serve every tensor from glibc's heap, and keep up to 2 GiB of freed heap for reuse.

    Left alone, glibc maps each block above its mmap threshold (at most 32 MiB) afresh and
    unmaps it on free, and trims the heap's freed top, so the next op pays page faults and the
    kernel's zeroing of the same memory again. A CPU training step frees and reallocates many
    50-500 MB activations: the BaseLM step of benchmarks/drt.py at 4K in bf16-mixed spent more
    time in the kernel than in user code. With mmap off for allocations (M_MMAP_MAX 0) and a
    2 GiB trim threshold the training steps there ran 1.7-2.6x faster (that one 3.8 s against
    9.6 s), their peak memory 7-21% higher, and a bf16 streaming prefill of the demo DRT about as
    fast as with the mmap threshold at 32 MiB, at the same peak RSS (docs/results.md, R6). The
    heap still shrinks on `release_freed_memory()`, which the trainer calls every log interval.

    Limits: freed memory inside the heap is kept (and its top up to 2 GiB) until
    `release_freed_memory()`, so a long loop of your own may call that now and then; blocks over
    about 64 MiB allocated by a thread other than the main one, and the main heap when the
    system refuses to grow it, still come from mmap; a large realloc is copied instead of
    remapped.

    Process-wide, so the command line and the benchmarks call it; a library user may too. It is
    skipped when the environment sets FARSIGHT_DEFAULT_MALLOC=1. Returns True when applied,
    False elsewhere (not glibc, or opted out).
    """
    if _GLIBC is None or os.environ.get(TUNE_MALLOC_ENV, "") not in ("", "0"):
        return False
    return bool(_GLIBC.mallopt(_M_MMAP_MAX, 0)) and bool(_GLIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
