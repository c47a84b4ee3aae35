"""Retrieval top-k over a long chunk memory: every key scored in fp32 (the reference) vs the
bf16 screen with exact rescoring (farsight.ops.retrieval), as a DRT prefill calls it.

    python benchmarks/retrieval.py [--quick] [--json PATH]

One call = the m = 64 landmarks of a 64-chunk prefill segment (d_model 128, top 4) scoring n
memory keys, n = 16K ... 512K chunks (0.5M ... 16M tokens at 32 tokens per chunk). Both paths
run in the same process on the same inputs (trained-like keys: random, with a norm spread), and
the script checks that they retrieve the same chunks. The screen pays only where bf16 matmuls run
in hardware; the last line says which path retrieval_topk's "auto" takes on this machine.
"""

from __future__ import annotations

import argparse
import math

import torch

from farsight.eval.efficiency import format_table, machine_description, time_fn, write_json
from farsight.eval.needle import format_length
from farsight.ops.retrieval import retrieval_topk_reference, retrieval_topk_screened, screen_pays_off

QUERIES, D_MODEL, TOP_K = 64, 128, 4


def case(n: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, QUERIES, D_MODEL, generator=g)
    keys = torch.randn(1, n, D_MODEL, generator=g) * torch.rand(1, n, 1, generator=g).add(0.5)
    keys_low, max_norm = keys.bfloat16(), keys.norm(dim=-1).max()
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(QUERIES) + n - QUERIES
    scale = 1 / math.sqrt(D_MODEL)
    ref = retrieval_topk_reference(query, keys, TOP_K, start, stop, scale)
    got = retrieval_topk_screened(query, keys, TOP_K, start, stop, scale, keys_low, max_norm)
    same = torch.equal(ref[0].sort(-1).values, got[0].sort(-1).values)
    ref_s = time_fn(lambda: retrieval_topk_reference(query, keys, TOP_K, start, stop, scale), warmup=1, repeat=repeat)
    screened_s = time_fn(lambda: retrieval_topk_screened(query, keys, TOP_K, start, stop, scale, keys_low, max_norm), warmup=1, repeat=repeat)
    return {
        "keys": format_length(n),
        "tokens": format_length(n * 32),
        "fp32 ms": 1000 * ref_s,
        "screened ms": 1000 * screened_s,
        "speedup": ref_s / screened_s,
        "same top-k": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16K and 64K keys only")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    sizes = [1 << 14, 1 << 16] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 19]
    rows = [case(n, 3 if args.quick else 5) for n in sizes]
    print(f"retrieval top-{TOP_K} of {QUERIES} queries, d_model {D_MODEL}, batch 1 ({torch.get_num_threads()} threads)")
    print(format_table(rows, ["keys", "tokens", "fp32 ms", "screened ms", "speedup", "same top-k"]))
    screens = screen_pays_off(torch.device("cpu"))
    native = "has" if screens else "has no"
    print(f"auto on this CPU: {'screened' if screens else 'fp32'} (it {native} bf16 matrix instructions)")
    write_json(args.json, {"benchmark": "retrieval", "machine": machine_description(), "auto_screens": screens, "rows": rows})


if __name__ == "__main__":
    main()
