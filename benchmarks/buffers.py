"""GrowingBuffer: the latency of one-row appends across a doubling, plain vs spread growth.

    python benchmarks/buffers.py [--quick] [--json PATH]

A decoding DRT appends one landmark key [1, 1, 128] (bf16 for a bf16 model) per chunk. With
plain doubling the append that overflows the buffer copies every key so far, inside one decode
step; `spread_growth=True` (farsight.ops.buffers) moves them ahead, three rows per row appended,
over the appends from half capacity on. Each case fills a buffer with blocks of rows to one row
past half of its capacity, `rows`, and then times every single-row append up to one row past
`rows` (where plain doubling copies `rows` rows in one append), for both kinds of growth in the
same process, alternating: the total, the mean and the slowest append, and the ratio of the
slowest appends, plain / spread. 512K rows is DRT's landmark-key buffer at 16M tokens (32
tokens per chunk).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from farsight.eval.efficiency import format_table, machine_description, write_json
from farsight.eval.needle import format_length
from farsight.ops.buffers import GrowingBuffer

WIDTH = 128  # the demo model's d_model
FILL_BLOCK = 4096  # rows per append while filling to half capacity


def _append_times(rows: int, spread: bool) -> np.ndarray:
    """Milliseconds of each single-row append from rows / 2 + 1 to rows + 1 rows (rows a power of
    two, at least 2 FILL_BLOCK, so that the buffer's capacity is rows when the timing starts)."""
    buffer = GrowingBuffer(dim=1, spread_growth=spread)
    block = torch.randn(1, FILL_BLOCK, WIDTH).to(torch.bfloat16)
    while buffer.length < rows // 2 + 1:
        buffer.append(block[:, : min(FILL_BLOCK, rows // 2 + 1 - buffer.length)])
    assert buffer.capacity == rows
    row = block[:, :1]
    times = np.empty(rows // 2)
    for i in range(len(times)):
        start = time.perf_counter()
        buffer.append(row)
        times[i] = 1000 * (time.perf_counter() - start)
    assert buffer.capacity == 2 * rows  # the timed appends crossed the doubling
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64K rows only")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    sizes = [1 << 16] if args.quick else [1 << 16, 1 << 18, 1 << 19]
    rows_out = []
    for rows in sizes:
        results = {}
        for spread in (False, True, False, True):  # alternate, keep the second run of each
            results[spread] = _append_times(rows, spread)
        for spread in (False, True):
            times = results[spread]
            rows_out.append(
                {
                    "rows": format_length(rows),
                    "growth": "spread" if spread else "plain",
                    "MB at doubling": rows * WIDTH * 2 / 2**20,
                    "total ms": float(times.sum()),
                    "mean us": 1000 * float(times.mean()),
                    "max ms": float(times.max()),
                    "max plain / max spread": float(results[False].max() / times.max()) if spread else None,
                }
            )
    print(f"one-row appends [1, 1, {WIDTH}] bf16 from half capacity to one row past it\n")
    print(
        format_table(
            rows_out, ["rows", "growth", "MB at doubling", "total ms", "mean us", "max ms", "max plain / max spread"]
        )
    )
    if args.json:
        write_json(args.json, {"benchmark": "buffers", "machine": machine_description(), "appends": rows_out})


if __name__ == "__main__":
    main()
