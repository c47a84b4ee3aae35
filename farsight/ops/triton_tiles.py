"""What the Triton kernels of farsight.ops share: tile loads and stores, tile sizes, dot precision,
launch settings, and whether the kernels run under Triton's CPU interpreter.

Imported only when a Triton backend runs (it imports triton). For CPU tensors set
TRITON_INTERPRET=1 before the first import of a kernel module (kernels are created at import).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from farsight.errors import InputError
from farsight.ops.checks import check_positive_int

# Block pointers (a scalar base, shape and strides per tile instead of a tensor of 64-bit
# addresses) spill fewer registers on Triton 3.6; Triton 3.9 removed them in favour of tensor
# descriptors, so there tiles are addressed with int32 offsets from a scalar base.
BLOCK_POINTERS = tl.constexpr(tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9))


@triton.jit
def load_rows(X, base, row0, n_rows, D, row_stride, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of the [n_rows, D] matrix at X + base whose rows lie row_stride
    apart (e.g. one batch-head of a contiguous [B, T, H, D] tensor), zero-padded to [BLOCK, BLOCK_D]."""
    if BLOCK_POINTERS:
        block = tl.make_block_ptr(X + base, (n_rows, D), (row_stride, 1), (row0, 0), (BLOCK, BLOCK_D), (1, 0))
        return tl.load(block, boundary_check=(0, 1), padding_option="zero")
    rows = row0 + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    return tl.load(X + base + (rows[:, None] * row_stride + cols[None, :]), mask=mask, other=0.0)


@triton.jit
def store_rows(X, base, row0, n_rows, D, row_stride, value, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """`value` into the tile `load_rows` reads, cast to X's dtype; rows past n_rows and columns
    past D are dropped."""
    if BLOCK_POINTERS:
        block = tl.make_block_ptr(X + base, (n_rows, D), (row_stride, 1), (row0, 0), (BLOCK, BLOCK_D), (1, 0))
        tl.store(block, value.to(X.dtype.element_ty), boundary_check=(0, 1))
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        tl.store(X + base + (rows[:, None] * row_stride + cols[None, :]), value.to(X.dtype.element_ty), mask=mask)


@triton.jit
def add_rows(X, base, row0, n_rows, D, row_stride, value, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """`value` added atomically (fp32) to the tile `load_rows` reads."""
    rows = row0 + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    tl.atomic_add(X + base + (rows[:, None] * row_stride + cols[None, :]), value, mask=mask)


# Whether kernels are created for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(load_rows, triton.runtime.JITFunction)

# Warps per program and software-pipelining depth. With FARSIGHT_TRITON_AUTOTUNE=1 each kernel
# tries these on the GPU at its first call for each key (tile sizes) and input dtype and keeps
# the fastest for the process (each try compiles the kernel once more: seconds per setting);
# otherwise it launches with the kernel's own default.
AUTOTUNE = os.environ.get("FARSIGHT_TRITON_AUTOTUNE", "0") == "1"
LAUNCH_CONFIGS = [(4, 1), (4, 2), (8, 1), (8, 2)]


def autotuned(
    kernel: Any,
    key: list[str],
    default: tuple[int, int],
    reset_to_zero: list[str] | None = None,
    restore_value: list[str] | None = None,
) -> Any:
    """`kernel` launched with (warps, stages) `default`, or autotuned over LAUNCH_CONFIGS on a GPU
    with AUTOTUNE (outputs it accumulates into are zeroed, and buffers it updates restored,
    between trials). The interpreter ignores launch settings. One kernel may be wrapped twice
    with different defaults, e.g. one per head-dim range."""
    if INTERPRETED:
        return kernel
    configs = LAUNCH_CONFIGS if AUTOTUNE else [default]
    configs = [triton.Config({}, num_warps=warps, num_stages=stages) for warps, stages in configs]
    tuned = triton.autotune(configs=configs, key=key, reset_to_zero=reset_to_zero, restore_value=restore_value)(kernel)
    tuned.default_launch = default  # read by benchmarks/kernel_resources.py
    return tuned


def tile_size(size: int, cap: int) -> int:
    """A power of two >= size (tl.dot needs every tile dimension >= 16), at most `cap`."""
    return min(cap, max(16, triton.next_power_of_2(size)))


def check_block(name: str, value: int | None) -> None:
    check_positive_int(name, value, allow_none=True)
    if value is not None and (value < 16 or value & (value - 1)):
        raise InputError(f"{name} must be a power of two >= 16 (a tl.dot tile), got {value}")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's global setting: exact ("ieee") unless the user allowed TF32 with
    torch.set_float32_matmul_precision("high" / "medium"). Ignored for fp16/bf16."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter computes bf16 tl.dot wrongly, so bf16 runs in fp32 there."""
    return torch.float32 if INTERPRETED and dtype == torch.bfloat16 else dtype
