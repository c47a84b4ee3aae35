"""farsight's custom ops: FLOPs counted inside them, and the CPU flash-attention formula."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from farsight.ops.castle import castle_attention
from farsight.ops.castle.blockwise import operand_dtype
from farsight.ops.library import KERNELS, count_flops
from farsight.ops.precision import cpu_has_native_bf16
from farsight.ops.window import sliding_window_attention
from farsight.ops.window.banded import banded_block_size


def test_every_custom_op_is_a_torch_op():
    assert {"banded_attention", "banded_attention_backward", "gca_recompute", "castle_attention"} <= set(KERNELS)
    for name in KERNELS:
        assert hasattr(torch.ops.farsight, name)


def test_flops_inside_the_banded_window_op():
    q, k, v = (torch.randn(1, 512, 2, 64, requires_grad=True) for _ in range(3))
    block = banded_block_size(128, 512)
    span = (-(-127 // block) + 1) * block
    tiles = 2 * (512 // block)  # heads x query blocks
    want = 6 * 2 * tiles * block * span * 64  # S, PV forward; dP, dQ, dK, dV backward
    assert count_flops(lambda: sliding_window_attention(q, k, v, 128).sum().backward()) == want


def test_causal_sdpa_counts_the_attended_pairs():
    q, k, v = (torch.randn(1, 2, 512, 64, requires_grad=True) for _ in range(3))
    pairs = 512 * 513 // 2
    causal = count_flops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    assert causal == 6 * 2 * 64 * 2 * pairs
    full = count_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert full == 6 * 2 * 64 * 2 * 512 * 512


def test_castle_flops_are_counted_and_its_bf16_products_run_in_bf16():
    xs = [torch.randn(1, 64, 1, 16, requires_grad=True) for _ in range(6)]
    assert count_flops(lambda: castle_attention(*xs).sum().backward()) > 0
    cpu = torch.device("cpu")
    assert operand_dtype(torch.float32, cpu) == torch.float32
    assert operand_dtype(torch.float64, cpu) == torch.float64
    assert operand_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
