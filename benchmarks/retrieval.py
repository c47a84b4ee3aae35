"""Retrieval top-k over a long chunk memory: every key scored in fp32 (the reference) vs the two
exact screens of farsight.ops.retrieval (bf16, and low-rank in fp32), as a DRT prefill calls them.

    python benchmarks/retrieval.py [--quick] [--json PATH] [--model DIR] [--corpus DIR]

One call = the m = 64 landmarks of a 64-chunk prefill segment (d_model 128, top 4) scoring n
memory keys, n = 16K ... 512K chunks (0.5M ... 16M tokens at 32 tokens per chunk). Two kinds of
keys: "random" (Gaussian, with a norm spread) and "trained": --model's (default
models/demo-drt) landmark keys and queries from a 128K-token prefill of --corpus's held-out
split (default data/stdlib-byte, which `make demo` prepares), with n keys drawn from a Gaussian
of the same mean and covariance. All paths run in the same process on the same inputs, and the
script checks that every path retrieves the same chunks. "fit ms" is the low-rank screen's
LowRankKeys for all n keys (basis and projections), which a session's memory builds as it grows
(a refit, every key projected again, each time it doubles); the low-rank column is one retrieval
against it. The last line says
which path retrieval_topk's "auto" takes on this machine.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

import farsight.models.drt as drt_module
from farsight.data.token_files import load_token_dataset
from farsight.eval.efficiency import format_table, machine_description, time_fn, write_json
from farsight.eval.needle import format_length
from farsight.models import load_model
from farsight.ops.retrieval import (
    LOW_RANK_OVER_BF16_KEYS,
    LowRankKeys,
    retrieval_topk_lowrank,
    retrieval_topk_reference,
    retrieval_topk_screened,
    screen_pays_off,
)

QUERIES, TOP_K = 64, 4
PREFILL_TOKENS = 131072


def trained_keys(model_dir: str, corpus: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the last retrieval's 64 queries [1, 64, D], the mean [D] and a Cholesky factor [D, D] of
    the covariance of the landmark keys) after a prefill of held-out text."""
    model = load_model(model_dir).eval()
    tokens = load_token_dataset(corpus, "val").tokens
    ids = torch.from_numpy(np.asarray(tokens[:PREFILL_TOKENS], dtype=np.int64))[None]
    seen = []
    original = drt_module.retrieval_topk

    def record(query, keys, *args, **kwargs):
        seen.append((query, keys))
        return original(query, keys, *args, **kwargs)

    drt_module.retrieval_topk = record
    try:
        with torch.no_grad(), model.new_session(memory="device") as session:
            session.prefill(ids)
    finally:
        drt_module.retrieval_topk = original
    query, keys = seen[-1]
    keys = keys[0].double()
    covariance = torch.cov(keys.t()) + 1e-9 * torch.eye(keys.shape[1], dtype=torch.float64)
    scale = 1 / math.sqrt(keys.shape[1])
    return query[:, -QUERIES:] * scale, keys.mean(0), torch.linalg.cholesky(covariance)


def case(kind: str, n: int, repeat: int, trained: tuple | None) -> dict:
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        dim = 128
        query = torch.randn(1, QUERIES, dim, generator=g) / math.sqrt(dim)
        keys = torch.randn(1, n, dim, generator=g) * torch.rand(1, n, 1, generator=g).add(0.5)
    else:
        query, mean, factor = trained
        keys = (mean + torch.randn(n, len(mean), generator=g, dtype=torch.float64) @ factor.t()).float()[None]
    start, stop = torch.zeros(1, dtype=torch.long), torch.arange(QUERIES) + n - QUERIES
    keys_low, max_norm = keys.bfloat16(), keys.norm(dim=-1).max()

    def fit() -> LowRankKeys:
        fitted = LowRankKeys()
        fitted.update(keys)
        return fitted

    low_rank = fit()
    paths = {
        "fp32": lambda: retrieval_topk_reference(query, keys, TOP_K, start, stop, 1.0),
        "bf16 screen": lambda: retrieval_topk_screened(query, keys, TOP_K, start, stop, 1.0, keys_low, max_norm),
        "low-rank": lambda: retrieval_topk_lowrank(query, keys, TOP_K, start, stop, 1.0, low_rank),
    }
    ref = paths["fp32"]()[0].sort(-1).values
    same = all(torch.equal(ref, path()[0].sort(-1).values) for path in paths.values())
    times = {name: time_fn(path, warmup=1, repeat=repeat) for name, path in paths.items()}
    return {
        "keys": kind,
        "n": format_length(n),
        "tokens": format_length(n * 32),
        "rank": 0 if low_rank.basis is None else low_rank.basis.shape[1],
        "fit ms": 1000 * time_fn(fit, warmup=0, repeat=1),
        **{f"{name} ms": 1000 * seconds for name, seconds in times.items()},
        "bf16 speedup": times["fp32"] / times["bf16 screen"],
        "low-rank speedup": times["fp32"] / times["low-rank"],
        "same top-k": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16K and 64K keys only")
    parser.add_argument("--json", help="write the figures as JSON")
    parser.add_argument(
        "--model", default="models/demo-drt", help="the DRT whose keys and queries the trained case copies"
    )
    parser.add_argument("--corpus", default="data/stdlib-byte", help="token directory with a val split to prefill")
    args = parser.parse_args()
    sizes = [1 << 14, 1 << 16] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 19]
    trained = trained_keys(args.model, args.corpus)
    rows = [case(kind, n, 3 if args.quick else 5, trained) for kind in ("random", "trained") for n in sizes]
    print(
        f"retrieval top-{TOP_K} of {QUERIES} queries, d_model 128, batch 1 ({torch.get_num_threads()} threads); trained: {args.model}"
    )
    columns = [
        "keys",
        "n",
        "tokens",
        "rank",
        "fit ms",
        "fp32 ms",
        "bf16 screen ms",
        "low-rank ms",
        "bf16 speedup",
        "low-rank speedup",
        "same top-k",
    ]
    print(format_table(rows, columns))
    screens = screen_pays_off(torch.device("cpu"))
    if screens:
        auto = f"bf16 screen, low-rank screen from {LOW_RANK_OVER_BF16_KEYS // 1024}K keys where they have a basis (it has bf16 matrix instructions)"
    else:
        auto = "low-rank screen, fp32 scan where keys have no low-rank basis (it has no bf16 matrix instructions)"
    print(f"auto on this CPU: {auto}")
    write_json(
        args.json,
        {"benchmark": "retrieval", "machine": machine_description(), "auto_screens_bf16": screens, "rows": rows},
    )


if __name__ == "__main__":
    main()
