"""Training throughput per model kind and precision (train.precision), on the CPU.

    python benchmarks/train_throughput.py [--quick] [--kinds causal,sliding,...]
        [--precisions fp32,bf16-mixed,...] [--json PATH]
    python benchmarks/train_throughput.py --loss-steps N [--kinds ...] [--precisions ...] [--json PATH]

Each case (model kind x sequence length x precision) runs in a fresh process: a model with
d_model 256, 4 layers, 4 heads and a byte vocabulary (transformer with causal, sliding (window
256), castle or castle-swl (lookahead 256) attention, or DRT with its default chunking) takes
full AdamW steps on random tokens with a fixed number of tokens per step, in the given
precision as the trainer runs it; the table gives tokens/s (median step) and the peak-memory
growth of one step, each precision's speed relative to the first one listed, and each kind's
speed and memory relative to causal attention (in the first precision).

--loss-steps N, instead of timing, trains a tiny model of each kind (d_model 64, 2 layers, 8 x
128 tokens per step) for N steps through farsight's Trainer in each precision and for --seeds
seeds, on Python source (the standard library's `email` package, bytes; a seed fixes the
initialisation and the batches, shared by the precisions), and prints the final training and
validation losses and each precision's validation-loss gap to the first one, seed by seed:
whether a faster precision learns as well.

A precision written NAME:torch (e.g. bf16-mixed:torch) times NAME with torch's own kernels for
every matrix product: on a CPU without bf16 (or fp16) matrix instructions the trainer runs those
products as fp32 GEMMs (farsight.ops.precision.widened_matmuls), and this is the baseline that
measures what that buys. Elsewhere the two are the same.

    python benchmarks/train_throughput.py --utilisation [--models baselm,drt-x1,drt-x2,causal,castle]
        [--d-models 256,512] [--precisions fp32,bf16-mixed] [--compile off,on] [--length 4096]
        [--tokens 16384] [--steps 3] [--rounds 1] [--paired [models|compile]] [--flops-from JSON] [--json PATH]

--utilisation: how much of the CPU's matrix throughput training uses. The host's peak is
measured first in the same run (the best of repeated 2048^2 and 4096^2 matmuls, fp32 and, on
a CPU with bf16 matrix instructions, bf16; elsewhere bf16-mixed multiplies as fp32 GEMMs and its
share of the fp32 peak is the one that applies). Each model (8 layers, 64-dim heads, byte
vocabulary; `baselm`: sliding window 512 + ALiBi, the DRT paper's BaseLM; `drt-x1` / `drt-x2`: DRT with one / two retrieval groups, chunk
64, top 8, 2 encoder layers, window 512; `causal`: full attention (SDPA) + RoPE; `castle`: CASTLE
+ RoPE) at each d_model then takes full AdamW steps as the trainer takes them
(farsight.eval.efficiency.training_step: fused AdamW, loss-only forward, denormals flushed) on
random tokens, --tokens per step in sequences of --length, in each precision, compiled or not
(--compile, train.compile): tokens/s (median of --steps steps after one untimed step, which
holds the compilation, reported as compile s), and the achieved TFLOP/s = the model's
matrix-product FLOPs per token x tokens/s, against both peaks. The FLOPs per token are counted
once per model with torch's FlopCounterMode on one fp32 sequence (farsight.ops.library.count_flops:
what the eager step executes, inside farsight's custom ops too, SDPA counted over the causal
pairs), and serve every precision and compile setting; --flops-from takes them from an earlier
JSON instead (to time an older farsight, which cannot count them, against the same FLOPs).
--rounds N times every case N times, round by round (each case once per round, each in a fresh
process), and reports the median with the slowest and fastest round: on a shared host a model's
speed moves between runs by more than the targets' margins. --paired (or --paired models) times the
models of one width, precision and compile setting in one process instead, a step of each in
turn (farsight.eval.efficiency.time_interleaved, --steps rounds of steps), and adds each
model's step time over `baselm`'s as the median and range of the ratios of steps from the same
round: a slow or fast spell of the host falls on both sides of each ratio. --paired compile
steps one model eager and compiled in turn instead, and its compile speedup is the median of
the same-round ratios. The last lines judge DRT's
target: its step against `baselm`'s, over its FLOP ratio, at most 1.1 (with --paired models in each
compile setting from the same-round ratios; otherwise from the best of the compile settings'
medians).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from farsight.eval.efficiency import (
    format_table,
    machine_description,
    measure_peak_memory,
    paired_ratio,
    run_isolated,
    time_fn,
    time_interleaved,
    training_step,
    write_json,
)
from farsight.models import build_model
from farsight.train.config import PRECISIONS
from farsight.train.metrics import read_metrics

TOKENS_PER_STEP = 8192
WINDOW = 256
KINDS = ("causal", "sliding", "castle", "castle-swl", "drt")
EXTRA = {"sliding": {"window": WINDOW}, "castle-swl": {"lookahead_window": WINDOW}}


def model_spec(kind: str, **sizes: int) -> dict:
    if kind == "drt":
        return {"type": "drt", **sizes}
    return {"type": "transformer", "attention": kind, **EXTRA.get(kind, {}), **sizes}


def _case(case: dict) -> dict:
    torch.manual_seed(0)
    name, _, kernels = case["precision"].partition(":")
    model = build_model(model_spec(case["kind"], vocab_size=260, d_model=256, n_layers=4, n_heads=4))
    length = case["length"]
    ids = torch.randint(0, 256, (max(1, TOKENS_PER_STEP // length), length))
    step = training_step(model, ids, name, widen=kernels != "torch")
    step()  # optimizer state allocated before the memory measurement
    peak = measure_peak_memory(step)
    seconds = time_fn(step, warmup=0, repeat=case["repeat"])
    return {"tokens_per_s": ids.numel() / seconds, "step_s": seconds, "peak_mb": peak / 2**20}


def _loss_case(case: dict) -> dict:
    from farsight.train.config import TrainConfig
    from farsight.train.trainer import train

    config = TrainConfig.from_dict(
        {
            "model": model_spec(case["kind"], d_model=64, n_layers=2, n_heads=2),
            "data": {"path": case["data"], "seq_len": 128, "batch_size": 8},
            "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20},
            "train": {
                "steps": case["steps"],
                "out_dir": case["out_dir"],
                "precision": case["precision"],
                "seed": case["seed"],
                "device": "cpu",
                "log_interval": case["steps"],
                "eval_interval": case["steps"],
                "eval_batches": 8,
                "checkpoint_interval": case["steps"],
                "progress": False,
            },
        }
    )
    start = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - start
    last = [loss for _, loss in result.losses[-10:]]
    val = [r["val_loss"] for r in read_metrics(Path(case["out_dir"]) / "metrics.jsonl") if "val_loss" in r]
    return {"train_loss": sum(last) / len(last), "val_loss": val[-1], "seconds": seconds}


UTIL_MODELS = ("baselm", "drt-x1", "drt-x2", "causal", "castle")
UTIL_LAYERS = 8
HEAD_DIM = 64
PEAK_SIZES = (2048, 4096)
DRT_TARGET = 1.1  # DRT's step time over BaseLM's, at most this times their FLOP ratio


def util_model(name: str, d_model: int) -> torch.nn.Module:
    """The benchmark's model `name` at `d_model` (see the module doc), seeded."""
    from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

    torch.manual_seed(0)
    sizes = {"vocab_size": 260, "d_model": d_model, "n_layers": UTIL_LAYERS, "n_heads": d_model // HEAD_DIM}
    if name in ("baselm", "drt-x1", "drt-x2"):
        groups = 2 if name == "drt-x2" else 1
        config = DRTConfig(**sizes, chunk_size=64, window=512, top_k=8, groups=groups, encoder_layers=2)
        return DRTForCausalLM(config) if name.startswith("drt") else TransformerForCausalLM(config.block_config())
    return TransformerForCausalLM(TransformerConfig(**sizes, attention=name))


def _peak_case(case: dict) -> dict:
    """The best matmul TFLOP/s of fp32 and bf16 over PEAK_SIZES (and each size's), repeated.

    bf16 only where the CPU multiplies it in hardware: elsewhere torch's software kernel takes
    minutes per 4096^2 product, and bf16-mixed training runs its products as fp32 GEMMs anyway
    (farsight.ops.precision.widened_matmuls), so the fp32 peak is the one that applies."""
    from farsight.ops.precision import software_matmul_dtypes

    peaks = {}
    software = software_matmul_dtypes(torch.device("cpu"))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if dtype in software:
            peaks[name] = None
            continue
        for n in PEAK_SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            seconds = time_fn(lambda a=a, b=b: a @ b, warmup=2, repeat=case["repeat"])
            peaks[f"{name} {n}^2"] = 2 * n**3 / seconds / 1e12
        peaks[name] = max(peaks[f"{name} {n}^2"] for n in PEAK_SIZES)
    return peaks


def _flops_case(case: dict) -> dict:
    """Matrix-product FLOPs per token of one fp32 eager training step on one sequence."""
    from farsight.ops.library import count_flops

    model = util_model(case["model"], case["d_model"])
    ids = torch.randint(0, 256, (1, case["length"]))
    step = training_step(model, ids, "fp32")
    return {"flops_per_token": count_flops(step) / ids.numel()}


def _prepared_step(case: dict) -> tuple[Callable[[], None], dict]:
    """The trainer's step of `case`'s model, after its first (untimed) call, which holds the
    compilation: (step, {"tokens", "first_step_s", "compile_s"})."""
    model = util_model(case["model"], case["d_model"])
    length = case["length"]
    ids = torch.randint(0, 256, (max(1, case["tokens"] // length), length))
    # uncompiled, the call an older farsight takes too (the baseline run, with --flops-from)
    options = {"compile": True} if case["compile"] else {}
    step = training_step(model, ids, case["precision"], **options)
    compile_s = 0.0
    start = time.perf_counter()
    if case["compile"]:
        from farsight.train.compile import CompileClock

        with CompileClock() as clock:
            step()
        compile_s = clock.seconds
    else:
        step()
    return step, {"tokens": ids.numel(), "first_step_s": time.perf_counter() - start, "compile_s": compile_s}


def _timed(info: dict, times: list[float]) -> dict:
    seconds = statistics.median(times)
    return {**info, "step_s": seconds, "tokens_per_s": info["tokens"] / seconds, "step_times": times}


def _util_case(case: dict) -> dict:
    """Time the trainer's step of one model in one precision, compiled or not."""
    step, info = _prepared_step(case)
    times = []
    for _ in range(case["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return _timed(info, times)


def _run_name(case: dict) -> str:
    return f"{case['model']} compile {'on' if case['compile'] else 'off'}"


def _paired_case(together: dict) -> dict:
    """Time the trainer's steps of several cases in one process, one step of each in turn
    (time_interleaved): {_run_name(case): what _util_case returns}."""
    prepared = {_run_name(case): _prepared_step(case) for case in together["cases"]}
    times = time_interleaved({name: step for name, (step, _) in prepared.items()}, warmup=0, rounds=together["steps"])
    return {name: _timed(info, times[name]) for name, (_, info) in prepared.items()}


def _peaks_text(peaks: dict) -> str:
    def one(name: str) -> str:
        if name in peaks and peaks[name] is None:
            return f"{name} none (no {name} matrix instructions: {name}-mixed multiplies as fp32 GEMMs)"
        return f"{name} {peaks.get(name) or 0:.3f} TFLOP/s"

    return ", ".join(one(name) for name in ("fp32", "bf16"))


def _drt_target_lines(rows: list[dict]) -> list[str]:
    """DRT's step against BaseLM's over its FLOP ratio (target 1.1): with --paired, the median of
    the same-round step ratios in each compile setting; otherwise the best of the compile
    settings' medians."""
    lines = []

    def line(name: str, time_ratio: float, flop_ratio: float, spread: str = "") -> str:
        verdict = "met" if time_ratio <= DRT_TARGET * flop_ratio else "NOT MET"
        return (
            f"  [{verdict}] {name}: {time_ratio:.2f}x baselm's time{spread} for {flop_ratio:.2f}x its FLOPs "
            f"= {time_ratio / flop_ratio:.3f}x the FLOP ratio (target <= {DRT_TARGET})"
        )

    mflop = {(r["model"], r["d_model"]): r["MFLOP/token"] for r in rows}
    for row in rows:
        base = mflop.get(("baselm", row["d_model"]))
        if row.get("/ baselm step") and row["MFLOP/token"] and base and row["model"].startswith("drt"):
            name = f"{row['model']} d{row['d_model']} {row['precision']} compile {row['compile']}"
            spread = f" ({row['/ baselm min']:.2f}-{row['/ baselm max']:.2f} step by step)"
            lines.append(line(name, row["/ baselm step"], row["MFLOP/token"] / base, spread))
    if lines:
        return lines
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["model"], row["d_model"], row["precision"])
        if row.get("tok/s") and (key not in best or row["tok/s"] > best[key]["tok/s"]):
            best[key] = row
    for (model, d_model, precision), drt in best.items():
        base = best.get(("baselm", d_model, precision))
        if not model.startswith("drt") or base is None or not (drt["MFLOP/token"] and base["MFLOP/token"]):
            continue
        time_ratio, flop_ratio = base["tok/s"] / drt["tok/s"], drt["MFLOP/token"] / base["MFLOP/token"]
        lines.append(line(f"{model} d{d_model} {precision}", time_ratio, flop_ratio))
    return lines


def utilisation(
    models: list[str],
    d_models: list[int],
    precisions: list[str],
    compile_settings: list[bool],
    length: int,
    tokens: int,
    steps: int,
    flops_from: str | None,
    rounds: int = 1,
    paired: str | None = None,
) -> dict:
    import json

    start = time.perf_counter()
    peaks = run_isolated(_peak_case, {"repeat": 5})
    print(f"  peaks: {_peaks_text(peaks)}", flush=True)
    known = {}
    if flops_from:
        for row in json.loads(Path(flops_from).read_text())["utilisation_rows"]:
            known[(row["model"], row["d_model"])] = row.get("MFLOP/token")
    mflops = {}
    for d_model in d_models:
        for model in models:
            mflop = known.get((model, d_model))
            if mflop is None and not flops_from:
                counted = run_isolated(_flops_case, {"model": model, "d_model": d_model, "length": length})
                mflop = counted["flops_per_token"] / 1e6 if "flops_per_token" in counted else None
            mflops[(model, d_model)] = mflop
    cases = [
        {"model": m, "d_model": d, "precision": p, "compile": c, "length": length, "tokens": tokens, "steps": steps}
        for d in d_models
        for m in models
        for p in precisions
        for c in compile_settings
    ]

    def key(case: dict) -> tuple:
        return case["model"], case["d_model"], case["precision"], case["compile"]

    def group_of(case: dict) -> tuple:
        """The process a --paired case shares: one per width, precision and compile setting
        (models) or model (compile), not one for all: three d_model-512 models' freed
        activations already held 20 GB of heap."""
        return key(case)[1:3] + ((case["compile"],) if paired == "models" else (case["model"],))

    def report(round_index: int, case: dict, got: dict) -> None:
        print(
            f"  round {round_index + 1}/{rounds} {case['model']} d{case['d_model']} {case['precision']} "
            f"compile {'on' if case['compile'] else 'off'}: {got.get('tokens_per_s', 0):.0f} tok/s "
            f"({time.perf_counter() - start:.0f}s)",
            flush=True,
        )

    # Every case once per round, in the same order: a host that slows down or speeds up during the
    # run then touches every case's median, not only the cases timed late.
    results: dict[tuple, list[dict]] = {key(case): [] for case in cases}
    for round_index in range(rounds):
        if paired:
            for group in dict.fromkeys(group_of(c) for c in cases):
                members = [c for c in cases if group_of(c) == group]
                got = run_isolated(_paired_case, {"cases": members, "steps": steps}, timeout=3600 * len(members))
                for case in members:
                    results[key(case)].append(got.get(_run_name(case), got))
                    report(round_index, case, results[key(case)][-1])
        else:
            for case in cases:
                results[key(case)].append(run_isolated(_util_case, case, timeout=3600))
                report(round_index, case, results[key(case)][-1])
    rows = []
    for case in cases:
        got = results[key(case)]
        mflop = mflops[(case["model"], case["d_model"])]
        row = {
            "model": case["model"],
            "d_model": case["d_model"],
            "precision": case["precision"],
            "compile": "on" if case["compile"] else "off",
            "MFLOP/token": mflop,
        }
        timed = [r for r in got if "error" not in r]
        if not timed:
            row["error"] = got[-1]["error"]
            rows.append(row)
            continue
        speeds = [r["tokens_per_s"] for r in timed]
        row |= {
            "tok/s": statistics.median(speeds),
            "step s": statistics.median(r["step_s"] for r in timed),
            "compile s": statistics.median(r["compile_s"] for r in timed) if case["compile"] else None,
            "step times": [t for r in timed for t in r["step_times"]],
        }
        if rounds > 1:
            row |= {"tok/s min": min(speeds), "tok/s max": max(speeds), "rounds tok/s": speeds}
        if mflop:
            achieved = mflop * 1e6 * row["tok/s"] / 1e12
            row["TFLOP/s"] = achieved
            row["% bf16 peak"] = 100 * achieved / peaks["bf16"] if peaks.get("bf16") else None
            row["% fp32 peak"] = 100 * achieved / peaks["fp32"] if peaks.get("fp32") else None
        rows.append(row)

    by_case = {key(case): row for case, row in zip(cases, rows)}
    for case, row in zip(cases, rows):
        model, d_model, precision, compiled = key(case)
        off = by_case.get((model, d_model, precision, False), {})
        if compiled and paired == "compile" and "step times" in off and "step times" in row:
            row["compile speedup"] = paired_ratio(off["step times"], row["step times"])["median"]
        elif compiled and off.get("tok/s") and row.get("tok/s"):
            row["compile speedup"] = row["tok/s"] / off["tok/s"]
        # --paired models: the step time over baselm's from steps of the same round, same process
        base = by_case.get(("baselm", d_model, precision, compiled), {})
        if paired == "models" and model != "baselm" and "step times" in row and "step times" in base:
            ratio = paired_ratio(row["step times"], base["step times"])
            row |= {"/ baselm step": ratio["median"], "/ baselm min": ratio["min"], "/ baselm max": ratio["max"]}
    columns = ["model", "d_model", "precision", "compile", "tok/s"]
    columns += ["tok/s min", "tok/s max"] if rounds > 1 else []
    columns += ["step s", "compile s", "MFLOP/token", "TFLOP/s", "% bf16 peak", "% fp32 peak", "compile speedup"]
    columns += ["/ baselm step", "/ baselm min", "/ baselm max"] if any("/ baselm step" in r for r in rows) else []
    columns += ["error"] if any("error" in r for r in rows) else []
    print(
        f"\nTraining utilisation, {UTIL_LAYERS} layers, {HEAD_DIM}-dim heads, {tokens} tokens/step at T={length}, "
        f"{torch.get_num_threads()} threads, median of {rounds} round(s)"
        f"{f', {paired} stepped in turn in one process' if paired else ''}; peaks: {_peaks_text(peaks)}"
    )
    print(format_table(rows, columns))
    targets = _drt_target_lines(rows)
    if targets:
        print("\ntargets:\n" + "\n".join(targets))
    return {
        "peaks_tflops": peaks,
        "length": length,
        "tokens_per_step": tokens,
        "rounds": rounds,
        "paired": paired,
        "utilisation_rows": rows,
    }


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"--{what}: {unknown[0] if unknown else text!r} is not one of {', '.join(known)}")
    return names


def throughput(kinds: list[str], precisions: list[str], quick: bool) -> list[dict]:
    lengths = [512, 1024] if quick else [512, 1024, 2048, 4096, 8192]
    repeat = 1 if quick else 3
    base = precisions[0]
    rows = []
    start = time.perf_counter()
    for length in lengths:
        for kind in kinds:
            row: dict = {"length": length, "kind": kind}
            for precision in precisions:
                result = run_isolated(_case, {"kind": kind, "precision": precision, "length": length, "repeat": repeat})
                if "error" in result:
                    row[f"{precision} error"] = result["error"]
                    continue
                row[f"{precision} tok/s"] = result["tokens_per_s"]
                row[f"{precision} peak MB"] = result["peak_mb"]
            for precision in precisions[1:]:
                if f"{precision} tok/s" in row and f"{base} tok/s" in row:
                    row[f"speed {precision}/{base}"] = row[f"{precision} tok/s"] / row[f"{base} tok/s"]
            rows.append(row)
        same_length = [r for r in rows if r["length"] == length]
        causal = next((r for r in same_length if r["kind"] == "causal"), {})
        for row in same_length:
            if f"{base} tok/s" in row and f"{base} tok/s" in causal:
                row["speed vs causal"] = row[f"{base} tok/s"] / causal[f"{base} tok/s"]
                row["memory vs causal"] = row[f"{base} peak MB"] / max(causal[f"{base} peak MB"], 1e-9)
        print(f"  length {length} done ({time.perf_counter() - start:.0f}s)", flush=True)
    columns = ["length", "kind"]
    columns += [f"{p} tok/s" for p in precisions] + [f"speed {p}/{base}" for p in precisions[1:]]
    columns += [f"{p} peak MB" for p in precisions]
    columns += ["speed vs causal", "memory vs causal"] if "causal" in kinds and len(kinds) > 1 else []
    columns += [c for c in sorted({k for r in rows for k in r}) if c.endswith(" error")]
    print(
        f"\nTraining throughput, d_model 256, 4 layers, 4 heads, {TOKENS_PER_STEP} tokens/step, "
        f"window {WINDOW}, {torch.get_num_threads()} threads"
    )
    print(format_table(rows, columns))
    for precision in precisions[1:]:
        ratios = []
        for kind in kinds:
            found = [
                r[f"speed {precision}/{base}"] for r in rows if r["kind"] == kind and f"speed {precision}/{base}" in r
            ]
            if found:
                ratios.append(f"{kind} {math.exp(sum(map(math.log, found)) / len(found)):.2f}x")
        print(f"speed {precision}/{base} by kind (geometric mean over lengths): {', '.join(ratios) or '-'}")
    return rows


def loss_curves(kinds: list[str], precisions: list[str], steps: int, seeds: int) -> list[dict]:
    from farsight.data.token_files import prepare_corpus

    base = precisions[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens"
        prepare_corpus(
            [str(Path(sysconfig.get_paths()["stdlib"]) / "email")], "byte", data, val_fraction=0.1, progress=False
        )
        for kind in kinds:
            for seed in range(seeds):
                row: dict = {"kind": kind, "seed": seed}
                for precision in precisions:
                    case = {"kind": kind, "precision": precision, "seed": seed, "steps": steps, "data": str(data)}
                    result = run_isolated(_loss_case, case | {"out_dir": f"{tmp}/{kind}-{precision}-{seed}"})
                    if "error" in result:
                        row[f"{precision} error"] = result["error"]
                        continue
                    row |= {f"{precision} {key}": value for key, value in result.items()}
                rows.append(row)
    columns = ["kind", "seed"] + [f"{p} {key}" for key in ("train_loss", "val_loss", "seconds") for p in precisions]
    columns += [c for c in sorted({k for r in rows for k in r}) if c.endswith(" error")]
    print(
        f"\nLoss after {steps} steps (train: mean of the last 10 steps; val: 8 held-out batches), "
        "d_model 64, 2 layers, 1024 tokens/step"
    )
    print(format_table(rows, columns))
    for kind in kinds:
        for precision in precisions[1:]:
            pairs = [r for r in rows if r["kind"] == kind and f"{precision} val_loss" in r and f"{base} val_loss" in r]
            if pairs:
                gaps = [r[f"{precision} val_loss"] - r[f"{base} val_loss"] for r in pairs]
                spread = [r[f"{base} val_loss"] for r in pairs]
                print(
                    f"{kind}: val loss {precision} - {base} over {len(pairs)} seeds: mean {sum(gaps) / len(gaps):+.4f} "
                    f"(each: {', '.join(f'{g:+.4f}' for g in gaps)}); "
                    f"{base} val loss across seeds {min(spread):.4f}-{max(spread):.4f}"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two short lengths, one timed step")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated model kinds (default: {','.join(KINDS)})"
    )
    parser.add_argument(
        "--precisions",
        default="fp32,bf16-mixed",
        help=f"comma-separated, the first is the reference of the ratios (default: fp32,bf16-mixed; any of {','.join(PRECISIONS)}, each also as NAME:torch)",
    )
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        metavar="N",
        help="instead of timing, compare the losses after N training steps",
    )
    parser.add_argument("--seeds", type=int, default=3, help="with --loss-steps: train seeds 0..N-1 (default 3)")
    parser.add_argument(
        "--utilisation", action="store_true", help="tokens/s and TFLOP/s against the host's matmul peaks"
    )
    parser.add_argument(
        "--models", default=",".join(UTIL_MODELS), help=f"with --utilisation (default {','.join(UTIL_MODELS)})"
    )
    parser.add_argument("--d-models", default="256,512", help="with --utilisation: model widths (default 256,512)")
    parser.add_argument("--compile", default="off,on", help="with --utilisation: off, on or off,on (default)")
    parser.add_argument("--length", type=int, default=4096, help="with --utilisation: sequence length (default 4096)")
    parser.add_argument("--tokens", type=int, default=16384, help="with --utilisation: tokens per step (default 16384)")
    parser.add_argument("--steps", type=int, default=3, help="with --utilisation: timed steps per case (default 3)")
    parser.add_argument("--flops-from", help="with --utilisation: FLOPs per token from this earlier --json")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --utilisation: time every case this many times, round by round, and report the median (default 1)",
    )
    parser.add_argument(
        "--paired",
        nargs="?",
        const="models",
        choices=("models", "compile"),
        help="with --utilisation: step the models of a width, precision and compile setting (models, the "
        "default) or the compile settings of a model (compile) in turn in one process, and take DRT's step "
        "over baselm's, or compile's speedup, from steps of the same round",
    )
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    if args.utilisation:
        if args.rounds < 1 or args.steps < 1:
            name, value = ("--rounds", args.rounds) if args.rounds < 1 else ("--steps", args.steps)
            raise SystemExit(f"{name} must be at least 1, got {value}")
        precisions = _names(args.precisions, PRECISIONS, "precisions")
        settings = [{"off": False, "on": True}[x] for x in _names(args.compile, ("off", "on"), "compile")]
        payload = {"benchmark": "train_utilisation", "machine": machine_description()}
        payload |= utilisation(
            _names(args.models, UTIL_MODELS, "models"),
            [int(x) for x in args.d_models.split(",")],
            precisions,
            settings,
            args.length,
            args.tokens,
            args.steps,
            args.flops_from,
            args.rounds,
            args.paired,
        )
        write_json(args.json, payload)
        return
    kinds = _names(args.kinds, KINDS, "kinds")
    precisions = _names(args.precisions, PRECISIONS + tuple(f"{p}:torch" for p in PRECISIONS), "precisions")
    payload = {"benchmark": "train_throughput", "machine": machine_description()}
    if args.loss_steps > 0:
        if any(":" in p for p in precisions):
            raise SystemExit(
                "--loss-steps trains through farsight's trainer, which has no NAME:torch variant; drop the :torch"
            )
        payload["loss_rows"] = loss_curves(kinds, precisions, args.loss_steps, args.seeds)
    else:
        payload["rows"] = throughput(kinds, precisions, args.quick)
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
