"""DRT efficiency: training step vs the sliding-window BaseLM, streaming prefill per memory tier,
and decode latency vs context length.

    python benchmarks/drt.py [--quick] [--json PATH] [--parts train,prefill,decode]

(a) training: one AdamW step of DRT and of BaseLM (sliding window + ALiBi) with the same layers,
    d_model and window (d_model 256, 8 layers, 4 heads, W 512; DRT: S 64, K 8, G 1, 2 encoder
    layers), 16K tokens per step (--train-tokens), at T = 1K, 4K, 16K (--train-lengths), on --train-device (default
    the CPU), in each of --train-precisions (the
    trainer's precisions, default fp32; e.g. fp32,bf16-mixed), compiled with --train-compile:
    time and peak-memory growth, DRT/BaseLM, and the ratio of the matrix-product FLOPs the two
    steps execute (torch's FlopCounterMode, inside farsight's custom ops too:
    farsight.ops.library.count_flops).
(b) prefill: the demo-sized DRT (d_model 128, 4 layers, S 32, W 64, K 4, 1 encoder layer) streams
    T random tokens through a session, batch 1: tokens/s and the process's peak RSS, per tier.
(c) decode: after a prefill of t tokens (--decode-lengths, default 4K, 64K, 1M; one session per
    length in one process, their steps timed in rounds of 16 that take the sessions in turn), the mean latency of
    128 single-token steps (four chunk boundaries, so four retrievals), ratio to the first
    length, and the median and slowest step (a pause shows there); peak RSS is the process's
    after each prefill (in the order given); --decode-memory picks the tier (disk for 16M),
    --decode-dtype the model dtype and --decode-model a trained model (default: random weights, whose landmark scores can be too
    close for the bf16 screen of farsight.ops.retrieval to rule keys out, so that every key is
    scored in fp32: decode at 16M measured 1.62x of 4K with random weights, 1.15x with the demo
    model).
(d) split: where a long streaming prefill spends its time (demo-sized DRT with random weights,
    or --split-model DIR such as models/demo-drt; disk tier; fp32 or --split-dtype bfloat16):
    lower layers, chunk encoder, chunk-memory writes, landmark scoring and top-k, chunk reads,
    GCA, the upper layers' window attention + MLP, and the rest, at --split-lengths (default 1M
    and 4M; 64K and 256K with --quick). Tokens are random, or --split-corpus DIR's training split.
    With --split-baseline each length also runs with every landmark key scored in fp32 (the
    retrieval before the screens of farsight.ops.retrieval), with --split-lowrank-baseline with
    no low-rank screen (the bf16 screen where bf16 is native, else the fp32 scan), and the
    speedup is printed.
    Timed by wrapping the model's steps in this script; the library is not instrumented.
Every case runs in a fresh process (farsight.eval.efficiency.run_isolated) with farsight's malloc
settings (farsight.process_memory.tune_malloc, as the command line runs); --malloc-baseline runs
parts (b) and (d) under glibc's defaults too and prints farsight's speedup over them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

import farsight.ops.retrieval
from farsight.data.token_files import load_token_dataset
from farsight.eval.efficiency import (
    format_table,
    machine_description,
    measure_peak_memory,
    run_isolated,
    time_fn,
    time_interleaved,
    training_step,
    write_json,
)
from farsight.eval.needle import format_length, parse_length
from farsight.models import DRTConfig, DRTForCausalLM, TransformerForCausalLM, load_model
from farsight.ops.library import count_flops
from farsight.process_memory import current_rss_bytes, peak_rss_bytes
from farsight.train.config import PRECISIONS

TRAIN_CONFIG = dict(
    vocab_size=260, d_model=256, n_layers=8, n_heads=4, chunk_size=64, window=512, top_k=8, groups=1, encoder_layers=2
)
STREAM_CONFIG = dict(
    vocab_size=260, d_model=128, n_layers=4, n_heads=4, chunk_size=32, window=64, top_k=4, groups=1, encoder_layers=1
)
TRAIN_TOKENS = 16384
DECODE_STEPS = 128
DECODE_ROUND = 16  # steps per session per round of part (c)
BLOCK = 1 << 16


def _train_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = DRTConfig(**TRAIN_CONFIG)
    return DRTForCausalLM(config) if name == "drt" else TransformerForCausalLM(config.block_config())


def _train_case(case: dict) -> dict:
    device = torch.device(case["device"])
    ids = torch.randint(0, 256, (max(1, case["tokens"] // case["length"]), case["length"]))
    model = _train_model(case["model"]).to(device)
    step = training_step(model, ids.to(device), case["precision"], compile=case.get("compile", False))
    # The step's matrix-product FLOPs (count_flops: FlopCounterMode seeing inside farsight's
    # custom ops). Triton kernels and FlexAttention are opaque to (or refuse) the counter, so on
    # a GPU they are counted on the CPU path for one sequence, times the rows.
    if device.type == "cpu":
        flops = count_flops(step)  # also the first step, which holds a compilation
    else:
        step()
        flops = count_flops(training_step(_train_model(case["model"]), ids[:1], "fp32")) * ids.shape[0]
    peak = measure_peak_memory(step, device)
    seconds = time_fn(step, device, warmup=1 if device.type == "cuda" else 0, repeat=case["repeat"])
    return {"step_s": seconds, "peak_mb": peak / 2**20, "gflop": flops / 1e9}


def _stream_model() -> DRTForCausalLM:
    torch.manual_seed(0)
    return DRTForCausalLM(DRTConfig(**STREAM_CONFIG)).eval()


def _blocks(total: int):
    generator = torch.Generator().manual_seed(1)
    for start in range(0, total, BLOCK):
        yield torch.randint(0, 256, (1, min(BLOCK, total - start)), generator=generator)


def _prefill_case(case: dict) -> dict:
    model = _stream_model()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/chunks.kv" if case["memory"] == "disk" else None
        base = current_rss_bytes()
        with model.new_session(memory=case["memory"], path=path) as session:
            start = time.perf_counter()
            session.prefill(_blocks(case["length"]))
            seconds = time.perf_counter() - start
            stored = session.memory.nbytes()
    return {
        "tokens_per_s": case["length"] / seconds,
        "peak_rss_mb": peak_rss_bytes() / 2**20,
        "rss_growth_mb": (peak_rss_bytes() - base) / 2**20,
        "memory_mb": stored / 2**20,
    }


def _decode_case(case: dict) -> dict:
    """Decode latency at every length of case["lengths"] in one process: one session per
    length, prefilled in turn, then DECODE_STEPS steps each, timed step by step in rounds of
    DECODE_ROUND steps that take the sessions in turn, the order rotated each round
    (time_interleaved), so that the baseline and the long context see the same machine (this
    CPU's step times move by 20% between processes)."""
    model = (load_model(case["model"]).eval() if case["model"] else _stream_model()).to(getattr(torch, case["dtype"]))
    token = torch.zeros(1, dtype=torch.long)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        sessions, rows = [], []
        for i, length in enumerate(case["lengths"]):
            path = f"{tmp}/chunks{i}.kv" if case["memory"] == "disk" else None
            session = stack.enter_context(model.new_session(memory=case["memory"], path=path))
            start = time.perf_counter()
            session.prefill(_blocks(length))
            rows.append({"prefill_s": time.perf_counter() - start, "peak_rss_mb": peak_rss_bytes() / 2**20})
            for _ in range(8):
                session.step(token)
            sessions.append(session)
        steps_ms: list[list[float]] = [[] for _ in sessions]

        def decode_round(session, times: list[float]) -> None:
            for _ in range(DECODE_ROUND):
                start = time.perf_counter()
                session.step(token)
                times.append(1000 * (time.perf_counter() - start))

        rounds = {i: functools.partial(decode_round, s, t) for i, (s, t) in enumerate(zip(sessions, steps_ms))}
        time_interleaved(rounds, warmup=0, rounds=DECODE_STEPS // DECODE_ROUND)
    return {
        "rows": [
            {"ms_per_token": float(np.mean(times)), "median_ms": float(np.median(times)), "max_ms": max(times), **row}
            for times, row in zip(steps_ms, rows)
        ]
    }


SPLIT_SECTIONS = ("lower layers", "encoder", "memory write", "scoring + top-k", "memory read", "GCA", "upper SWA + MLP")


def _timed(totals: dict[str, float], section: str, fn):
    """fn, adding its wall time to totals[section] (CPU ops are synchronous)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[section] += time.perf_counter() - start

    return wrapper


def _corpus_blocks(corpus: str, total: int):
    tokens = load_token_dataset(corpus, "train")
    if len(tokens) < total:
        raise SystemExit(
            f"{corpus} holds {len(tokens)} training tokens, fewer than the {total} asked; pick a shorter length"
        )
    for start in range(0, total, BLOCK):
        yield torch.from_numpy(np.asarray(tokens[start : min(total, start + BLOCK)], dtype=np.int64))[None]


def _split_case(case: dict) -> dict:
    if case["baseline"] == "fp32 scan":  # every landmark key scored in fp32: the retrieval before the screens
        farsight.ops.retrieval.SCREEN_MIN_KEYS = sys.maxsize
    elif case["baseline"] == "no low-rank":  # no memory fits a low-rank basis: the bf16 screen where native
        farsight.ops.retrieval.LOW_RANK_MIN_KEYS = sys.maxsize
    model = load_model(case["model"]).eval() if case["model"] else _stream_model()
    model = model.to(getattr(torch, case["dtype"]))
    totals: dict[str, float] = defaultdict(float)
    for block in model.lower:
        block.forward = _timed(totals, "lower layers", block.forward)
    for block in model.upper:
        for part in (block.attn, block.mlp):
            part.forward = _timed(totals, "upper SWA + MLP", part.forward)
        block.cross.forward = _timed(totals, "GCA", block.cross.forward)
    model.encode_chunks = _timed(totals, "encoder", model.encode_chunks)
    model._retrieve = _timed(totals, "scoring + top-k", model._retrieve)
    model._fetch = _timed(totals, "memory read", model._fetch)
    with tempfile.TemporaryDirectory() as tmp, model.new_session(memory="disk", path=f"{tmp}/chunks.kv") as session:
        session.memory.append = _timed(totals, "memory write", session.memory.append)
        blocks = _corpus_blocks(case["corpus"], case["length"]) if case["corpus"] else _blocks(case["length"])
        start = time.perf_counter()
        with torch.inference_mode():
            session.prefill(blocks)
        seconds = time.perf_counter() - start
    row = {"tokens_per_s": case["length"] / seconds, "seconds": seconds, "peak_rss_mb": peak_rss_bytes() / 2**20}
    for section in SPLIT_SECTIONS:
        row[f"{section} %"] = 100 * totals[section] / seconds
    row["rest %"] = 100 - sum(row[f"{section} %"] for section in SPLIT_SECTIONS)
    return row


def _speedups(rows: list[dict]) -> None:
    """rows of one case, baselines first and farsight's own run last: each baseline row gets the
    ratio of farsight's tokens/s to its own."""
    best = rows[-1].get("tokens_per_s")
    for row in rows[:-1]:
        if best and row.get("tokens_per_s"):
            row["farsight speedup"] = best / row["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short lengths only")
    parser.add_argument("--json", help="write the figures as JSON")
    parser.add_argument(
        "--parts", default="train,prefill,decode,split", help="comma-separated subset of train,prefill,decode,split"
    )
    parser.add_argument(
        "--decode-lengths", help="contexts of part (c), e.g. 4k,16m (default 4k,64k,1m; 4k,64k with --quick)"
    )
    parser.add_argument(
        "--train-precisions",
        default="fp32",
        help="comma-separated trainer precisions of part (a), e.g. fp32,bf16-mixed (default fp32)",
    )
    parser.add_argument(
        "--decode-memory", default="device", choices=["device", "host", "disk"], help="chunk memory tier of part (c)"
    )
    parser.add_argument(
        "--decode-dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype of part (c)"
    )
    parser.add_argument("--decode-model", help="model directory for part (c) (default: demo-sized, random weights)")
    parser.add_argument(
        "--split-lengths", help="lengths of part (d), e.g. 1m,4m,16m (default 1m,4m; 64k,256k with --quick)"
    )
    parser.add_argument(
        "--split-dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype of part (d)"
    )
    parser.add_argument("--split-model", help="model directory for part (d) (default: demo-sized, random weights)")
    parser.add_argument(
        "--split-corpus", help="prepared dataset whose training tokens part (d) streams (default: random tokens)"
    )
    parser.add_argument(
        "--split-baseline", action="store_true", help="part (d) also with every landmark key scored in fp32"
    )
    parser.add_argument(
        "--split-lowrank-baseline",
        action="store_true",
        help="part (d) also without the low-rank screen (the bf16 screen where bf16 is native)",
    )
    parser.add_argument(
        "--malloc-baseline",
        action="store_true",
        help="parts (b) and (d) also under glibc's default malloc settings (no tune_malloc)",
    )
    parser.add_argument("--train-device", default="cpu", help="device of part (a), e.g. cuda (default cpu)")
    parser.add_argument(
        "--train-compile", action="store_true", help="part (a) with the blocks and loss compiled (train.compile)"
    )
    parser.add_argument("--train-lengths", help="sequence lengths of part (a) (default 1k,4k,16k; 1k,4k with --quick)")
    parser.add_argument(
        "--train-tokens", type=int, default=TRAIN_TOKENS, help=f"tokens per training step (default {TRAIN_TOKENS})"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or not parts <= {"train", "prefill", "decode", "split"}:
        parser.error(f"--parts takes a comma-separated subset of train,prefill,decode,split, not {args.parts!r}")
    train_precisions = args.train_precisions.split(",")
    unknown = [p for p in train_precisions if p not in PRECISIONS or p == "auto"]
    if unknown:
        parser.error(
            f"--train-precisions takes a comma-separated subset of {','.join(p for p in PRECISIONS if p != 'auto')}, not {unknown}"
        )
    default_split = "64k,256k" if args.quick else "1m,4m"
    split_lengths = [parse_length(text) for text in (args.split_lengths or default_split).split(",")]
    default_train = "1k,4k" if args.quick else "1k,4k,16k"
    train_lengths = [parse_length(text) for text in (args.train_lengths or default_train).split(",")]
    prefill_lengths = [16384, 65536] if args.quick else [16384, 65536, 262144, 1 << 20]
    default_decode = "4k,64k" if args.quick else "4k,64k,1m"
    decode_contexts = [parse_length(text) for text in (args.decode_lengths or default_decode).split(",")]
    tiers = ["device", "host", "disk"]
    started = time.perf_counter()

    def note(what: str) -> None:
        print(f"  {what} done ({time.perf_counter() - started:.0f}s)", flush=True)

    train_rows = []
    for precision in train_precisions if "train" in parts else []:
        for length in train_lengths:
            row: dict = {"precision": precision, "T": format_length(length)}
            for name in ("baselm", "drt"):
                case = {
                    "model": name,
                    "length": length,
                    "precision": precision,
                    "repeat": 1 if args.quick else 3,
                    "device": args.train_device,
                    "tokens": args.train_tokens,
                    "compile": args.train_compile,
                }
                r = run_isolated(_train_case, case)
                row[f"{name} step s"] = r.get("step_s")
                row[f"{name} peak MB"] = r.get("peak_mb")
                row[f"{name} GFLOP"] = r.get("gflop")
                if "error" in r:
                    row[f"{name} error"] = r["error"]
            if row.get("drt step s") and row.get("baselm step s"):
                row["time DRT/BaseLM"] = row["drt step s"] / row["baselm step s"]
                row["FLOP DRT/BaseLM"] = row["drt GFLOP"] / row["baselm GFLOP"]
                row["memory DRT/BaseLM"] = row["drt peak MB"] / max(row["baselm peak MB"], 1e-9)
            train_rows.append(row)
            note(f"training {precision} T={format_length(length)}")

    prefill_rows = []
    for memory in tiers if "prefill" in parts else []:
        for length in prefill_lengths:
            rows = []
            for default_malloc in (True, False) if args.malloc_baseline else (False,):
                r = run_isolated(_prefill_case, {"memory": memory, "length": length}, default_malloc=default_malloc)
                variant = "default malloc" if default_malloc else "farsight"
                rows.append({"tier": memory, "T": format_length(length), "variant": variant, **r})
                note(f"prefill {memory} T={format_length(length)} ({variant})")
            _speedups(rows)
            prefill_rows += rows
    by_tier = {(r["tier"], r["T"]): r for r in prefill_rows if r["variant"] == "farsight"}
    for r in prefill_rows:
        ref = by_tier.get((r["tier"], "64K"))
        if ref and "peak_rss_mb" in r and "peak_rss_mb" in ref:
            r["RSS / RSS(64K)"] = r["peak_rss_mb"] / ref["peak_rss_mb"]

    decode_rows = []
    if "decode" in parts:
        case = {
            "memory": args.decode_memory,
            "dtype": args.decode_dtype,
            "lengths": decode_contexts,
            "model": args.decode_model,
        }
        r = run_isolated(_decode_case, case)
        rows = r.get("rows") or [{"error": r.get("error")} for _ in decode_contexts]
        decode_rows = [{"context": format_length(length), **row} for length, row in zip(decode_contexts, rows)]
        note(f"decode t={','.join(format_length(length) for length in decode_contexts)}")
    base_ms = decode_rows[0].get("ms_per_token") if decode_rows else None
    for r in decode_rows:
        if base_ms and "ms_per_token" in r:
            r[f"ratio to {decode_rows[0]['context']}"] = r["ms_per_token"] / base_ms

    # (variant name, retrieval baseline, glibc's default malloc): baselines first
    split_variants = [("fp32 scan", "fp32 scan", False)] if args.split_baseline else []
    split_variants += [("no low-rank", "no low-rank", False)] if args.split_lowrank_baseline else []
    split_variants += [("default malloc", None, True)] if args.malloc_baseline else []
    split_variants.append(("farsight", None, False))
    split_rows = []
    for length in split_lengths if "split" in parts else []:
        rows = []
        for variant, baseline, default_malloc in split_variants:
            case = {
                "length": length,
                "dtype": args.split_dtype,
                "model": args.split_model,
                "corpus": args.split_corpus,
                "baseline": baseline,
            }
            r = run_isolated(_split_case, case, default_malloc=default_malloc)
            rows.append({"T": format_length(length), "variant": variant, **r})
            note(f"split T={format_length(length)} ({variant})")
        _speedups(rows)
        split_rows += rows

    if train_rows:
        print(
            "\n(a) training step, DRT vs BaseLM (d_model 256, 8 layers, W 512; DRT S 64, K 8, 2 encoder layers), "
            f"{args.train_tokens:,} tokens/step on {args.train_device}"
        )
        columns = [
            "precision",
            "T",
            "baselm step s",
            "drt step s",
            "time DRT/BaseLM",
            "FLOP DRT/BaseLM",
            "baselm peak MB",
            "drt peak MB",
            "memory DRT/BaseLM",
        ]
        print(format_table(train_rows, columns))
    if prefill_rows:
        print("\n(b) streaming prefill, batch 1 (d_model 128, 4 layers, S 32, W 64, K 4, 1 encoder layer)")
        columns = [
            "tier",
            "T",
            "variant",
            "tokens_per_s",
            "peak_rss_mb",
            "RSS / RSS(64K)",
            "rss_growth_mb",
            "memory_mb",
        ]
        print(format_table(prefill_rows, columns + (["farsight speedup"] if args.malloc_baseline else [])))
    if decode_rows:
        print(
            f"\n(c) decode latency per token, mean of {DECODE_STEPS} steps after a prefill of t tokens "
            f"({args.decode_model or 'demo-sized DRT, random weights'}, {args.decode_memory} tier, {args.decode_dtype})"
        )
        print(
            format_table(
                decode_rows,
                [
                    "context",
                    "ms_per_token",
                    f"ratio to {decode_rows[0]['context']}",
                    "median_ms",
                    "max_ms",
                    "prefill_s",
                    "peak_rss_mb",
                ],
            )
        )
    if split_rows:
        what = args.split_model or "demo-sized DRT, random weights"
        tokens = f"{args.split_corpus} tokens" if args.split_corpus else "random tokens"
        print(
            f"\n(d) where a streaming prefill spends its time, % of wall time ({what}, {tokens}, disk tier, {args.split_dtype})"
        )
        columns = [
            "T",
            "variant",
            "tokens_per_s",
            "seconds",
            *(f"{s} %" for s in SPLIT_SECTIONS),
            "rest %",
            "peak_rss_mb",
        ]
        columns += ["farsight speedup"] if len(split_variants) > 1 else []
        print(format_table(split_rows, columns + (["error"] if any("error" in r for r in split_rows) else [])))
    checks = []
    for four_k in (r for r in train_rows if r["T"] == "4K" and "time DRT/BaseLM" in r):
        ratio = four_k["time DRT/BaseLM"]
        checks.append((f"training step DRT/BaseLM at 4K ({four_k['precision']}) <= 1.25", ratio, ratio <= 1.25))
    last = decode_rows[-1] if decode_rows else {}
    first = decode_rows[0]["context"] if decode_rows else ""
    if first == "4K" and "ratio to 4K" in last and last is not decode_rows[0]:
        checks.append(
            (f"decode at {last['context']} / decode at 4K <= 1.2", last["ratio to 4K"], last["ratio to 4K"] <= 1.2)
        )
    disk_1m = by_tier.get(("disk", "1M"))
    if disk_1m and "RSS / RSS(64K)" in disk_1m:
        checks.append(
            ("disk tier peak RSS at 1M / at 64K <= 1.2", disk_1m["RSS / RSS(64K)"], disk_1m["RSS / RSS(64K)"] <= 1.2)
        )
    device_1m = by_tier.get(("device", "1M"))
    if device_1m and "tokens_per_s" in device_1m:
        checks.append(
            ("prefill tokens/s at 1M (device) >= 50000", device_1m["tokens_per_s"], device_1m["tokens_per_s"] >= 50000)
        )
    if checks:
        print("\ntargets:")
        for what, value, ok in checks:
            print(f"  {'MET ' if ok else 'MISS'} {what}: {value:.3g}")
    write_json(
        args.json,
        {
            "benchmark": "drt",
            "machine": machine_description(),
            "training": train_rows,
            "prefill": prefill_rows,
            "decode": decode_rows,
            "split": split_rows,
            "targets": [{"target": w, "value": v, "met": ok} for w, v, ok in checks],
        },
    )


if __name__ == "__main__":
    main()
