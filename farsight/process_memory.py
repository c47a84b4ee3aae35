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
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 128 * 2**20
TUNE_MALLOC_ENV = "FARSIGHT_DEFAULT_MALLOC"


def release_freed_memory() -> None:
    """Give the memory that glibc keeps after freed CPU tensors back to the OS.

    glibc raises its mmap threshold after a large block is freed, so later activations come
    from the heap, which fragments and does not shrink: a CPU training run of the demo DRT grew
    by about 5 MB per step, to 24 GB and an out-of-memory kill at step 2740. Trimming every
    log interval keeps it near its working set (about 450 MB there).
    """
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


def tune_malloc() -> bool:
    """Keep freed tensor-sized blocks (up to 32 MiB) in glibc's heap for the next op to reuse.

    Left alone, glibc serves many of the 0.1-30 MB blocks a CPU forward allocates with a fresh
    mmap and returns them (or trims the heap top) when they are freed, so the next op pays page
    faults to zero the same memory again. Fixing the mmap threshold at its maximum (32 MiB) and
    the trim threshold at 128 MiB stops that churn: the demo DRT's bf16 streaming prefill ran
    1.3-1.7x faster up to 4M tokens with the same peak RSS (benchmarks/drt.py --malloc-baseline;
    over 16M tokens glibc's own threshold settles and the two are equal). The heap still shrinks
    on `release_freed_memory()`.

    Process-wide, so the command line and the benchmarks call it; a library user may too. It is
    skipped when the environment sets FARSIGHT_DEFAULT_MALLOC=1. Returns True when applied,
    False elsewhere (not glibc, or opted out).
    """
    if _GLIBC is None or os.environ.get(TUNE_MALLOC_ENV, "") not in ("", "0"):
        return False
    return bool(_GLIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(_GLIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
