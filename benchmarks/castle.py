"""CASTLE op benchmark: blockwise training path vs the O(T^3) reference vs SDPA, and decoding.

    python benchmarks/castle.py [--quick] [--json PATH] [--parts training,targets,decoding] [--rounds 9]

Every measured case runs in a fresh process (farsight.eval.efficiency.run_isolated, with
farsight's malloc settings as the command line has them), which
reports wall times (median of a few runs; one run from T=8192 on) and the peak-memory growth
of one call. Training cases use B=1, H=1, d=64 so that the memory columns show the scaling in
T; "fwd" runs under no_grad, "f+b" is one forward and one backward. The speed targets use one
fixed shape (B=1, H=4, d=64, T=2048 and 4096, fp32 and bf16): one process per T times the f+b of
SDPA, CASTLE and CASTLE-SWL in both dtypes in turn for --rounds rounds
(farsight.eval.efficiency.time_interleaved), and every ratio is the median of the ratios of
times from the same round, with the lowest and highest: on a shared host separate medians move
by more than the targets' margins, same-round ratios far less. They also count the matrix-
product FLOPs of one CASTLE f+b (torch's FlopCounterMode inside the custom op:
farsight.ops.library.count_flops) against causal SDPA's 7 products
(forward QK^T, PV; backward QK^T again, dV, dP, dQ, dK) over the T(T+1)/2 causal pairs: the
ratio of work that no unfused implementation can go below. Every op runs as the trainer runs it:
on a CPU without bf16 matrix instructions its bf16 products are fp32 GEMMs
(farsight.ops.precision.widened_matmuls; torch's own bf16 SDPA there ran 6x slower than fp32
and would flatter CASTLE). The decoding cases time one token against
a cache of t tokens (B=1, H=8, d=64): castle_decode with its UQ-KV cache (CASTLE and
CASTLE-SWL 512) vs a standard KV-cache step (one query against t cached keys with SDPA), and full
CASTLE's step once more with every update of U made in place
(farsight.ops.castle.inference.HOLD_BACK_FROM_ROWS out of reach), the way castle_decode ran before
it held updates back. Like the speed targets, one process per t decodes 64 tokens with each of
the four in turn for 15 rounds, and the ratios are medians of same-round ratios. The end of the output says which
of the targets the measured figures meet; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from farsight.eval.efficiency import (
    format_table,
    machine_description,
    measure_peak_memory,
    paired_ratio,
    run_isolated,
    time_fn,
    time_interleaved,
    write_json,
)
from farsight.ops.castle import CastleCache, castle_attention, castle_decode, castle_parallel_reference, inference
from farsight.ops.library import count_flops
from farsight.ops.precision import widened_matmuls

FULL_STEPS = [256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_STEPS = [256, 512, 1024, 2048]
FULL_WINDOWS: list[int | None] = [None, 128, 512]
QUICK_WINDOWS: list[int | None] = [None, 128]
FULL_DECODE_CONTEXTS = [1024, 4096, 8192]
QUICK_DECODE_CONTEXTS = [1024, 8192]
# The dense reference holds several [T, T] matrices and costs O(T^3): beyond this it is skipped.
FULL_REFERENCE_LIMIT = 4096
QUICK_REFERENCE_LIMIT = 2048
HEAD_DIM = 64
TARGET_HEADS = 4
FULL_TARGET_STEPS = [2048, 4096]
QUICK_TARGET_STEPS = [2048]
TARGET_DTYPES = ["float32", "bfloat16"]
TARGET_WINDOW = 512
TARGET_ROUNDS = 9
SDPA_CAUSAL_PRODUCTS = 7
PARTS = ("training", "targets", "decoding")
DECODE_HEADS = 8
DECODE_TOKENS = 64
DECODE_WARMUP, DECODE_REPEAT = 2, 15
DECODE_WINDOW = 512
CASE_TIMEOUT_S = 600.0


def _variant(window: int | None) -> str:
    return "castle" if window is None else f"swl-{window}"


def _op(
    impl: str, window: int | None, steps: int, heads: int, dtype: torch.dtype
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Fresh inputs for `impl` and its (forward, forward_backward) on them, run as the trainer runs
    them (bf16 products as fp32 GEMMs where the CPU has no bf16 matrix instructions), with kernels
    and thread pools loaded on a tiny problem first so that they count neither as peak memory nor
    as time."""
    shape = (1, heads, steps, HEAD_DIM) if impl == "sdpa" else (1, steps, heads, HEAD_DIM)
    inputs = [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3 if impl == "sdpa" else 6)]

    def op(xs: list[torch.Tensor]) -> torch.Tensor:
        if impl == "sdpa":
            return F.scaled_dot_product_attention(*xs, is_causal=True)
        if impl == "reference":
            return castle_parallel_reference(*xs, window=window)
        return castle_attention(*xs, window=window)

    def forward(xs: list[torch.Tensor] = inputs) -> None:
        with torch.no_grad(), widened_matmuls(torch.device("cpu"), dtype):
            op(xs)

    def forward_backward(xs: list[torch.Tensor] = inputs) -> None:
        for x in xs:
            x.grad = None
        with widened_matmuls(torch.device("cpu"), dtype):
            op(xs).sum().backward()

    time_axis = -2 if impl == "sdpa" else 1
    forward_backward([x.detach().narrow(time_axis, 0, 8).clone().requires_grad_() for x in inputs])
    return forward, forward_backward


def _train_case(case: dict) -> dict:
    """Subprocess body: peak memory of one forward and of one forward+backward, then times."""
    torch.manual_seed(0)
    steps = case["steps"]
    forward, forward_backward = _op(case["impl"], case["window"], steps, 1, torch.float32)
    forward_peak = measure_peak_memory(forward)
    backward_peak = measure_peak_memory(forward_backward)
    large = steps >= 8192
    repeat, warmup = (1, 0) if large else (3, 1)
    return {
        "fwd_s": time_fn(forward, warmup=warmup, repeat=repeat),
        "fwd_bytes": forward_peak,
        "fb_s": time_fn(forward_backward, warmup=warmup, repeat=repeat),
        "fb_bytes": backward_peak,
    }


def _speed_case(case: dict) -> dict:
    """Subprocess body: f+b times of SDPA, CASTLE and CASTLE-SWL in every target dtype at one T,
    interleaved round by round (time_interleaved), and each one's matrix-product FLOPs."""
    torch.manual_seed(0)
    steps = case["steps"]
    runs, flop = {}, {}
    for dtype in TARGET_DTYPES:
        for impl, window in (("sdpa", None), ("castle", None), ("castle", TARGET_WINDOW)):
            name = f"{'sdpa' if impl == 'sdpa' else _variant(window)} {dtype}"
            _, runs[name] = _op(impl, window, steps, TARGET_HEADS, getattr(torch, dtype))
            if impl == "sdpa":
                flop[name] = SDPA_CAUSAL_PRODUCTS * 2 * HEAD_DIM * TARGET_HEADS * steps * (steps + 1) // 2
            else:
                flop[name] = count_flops(runs[name])
    return {"times": time_interleaved(runs, warmup=1, rounds=case["rounds"]), "flop": flop}


DECODE_IMPLS = ("sdpa", "castle", _variant(DECODE_WINDOW), "castle-in-place")


def _decode_runner(impl: str, context: int, steps: list[list[torch.Tensor]]) -> Callable[[], None]:
    """One call decodes `steps` (DECODE_TOKENS tokens) after `context` cached ones with `impl`.

    Decoding changes the cache, so every call (warmup included) gets a fresh one, built here,
    untimed, with room for its tokens (no growth inside the timed loop). "castle-in-place" is
    CASTLE with every update of U made in place (HOLD_BACK_FROM_ROWS out of reach during its
    calls only)."""
    heads, dim, capacity = DECODE_HEADS, HEAD_DIM, context + len(steps)
    if impl == "sdpa":
        keys, values = torch.randn(1, heads, capacity, dim), torch.randn(1, heads, capacity, dim)

        def run_sdpa() -> None:
            for i, (q, k, v, *_) in enumerate(steps):
                pos = context + i
                keys[:, :, pos] = k[:, 0]
                values[:, :, pos] = v[:, 0]
                F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, : pos + 1], values[:, :, : pos + 1])

        return run_sdpa
    window = DECODE_WINDOW if impl == _variant(DECODE_WINDOW) else None
    prompt = [torch.randn(1, heads, context, dim) * 0.1 for _ in range(4)]
    caches = iter(
        [
            CastleCache(*prompt, window=window, scale=dim**-0.5, input_dtype=torch.float32, layer=0, capacity=capacity)
            for _ in range(DECODE_WARMUP + DECODE_REPEAT)
        ]
    )

    def run_castle() -> None:
        cache = next(caches)
        for token in steps:
            castle_decode(*token, cache)

    if impl != "castle-in-place":
        return run_castle

    def run_in_place() -> None:
        default, inference.HOLD_BACK_FROM_ROWS = inference.HOLD_BACK_FROM_ROWS, capacity + 1
        try:
            run_castle()
        finally:
            inference.HOLD_BACK_FROM_ROWS = default

    return run_in_place


def _decode_case(case: dict) -> dict:
    """Subprocess body: the DECODE_TOKENS-token decode of every DECODE_IMPLS entry after `context`
    cached tokens, timed in turn for DECODE_REPEAT rounds (time_interleaved): {"times": {impl:
    [seconds per call, round by round]}}."""
    torch.manual_seed(0)
    context = case["context"]
    steps = [[torch.randn(1, 1, DECODE_HEADS, HEAD_DIM) for _ in range(6)] for _ in range(DECODE_TOKENS)]
    runs = {impl: _decode_runner(impl, context, steps) for impl in DECODE_IMPLS}
    return {"times": time_interleaved(runs, warmup=DECODE_WARMUP, rounds=DECODE_REPEAT)}


def _measure(target, case: dict) -> dict:
    result = run_isolated(target, case, timeout=CASE_TIMEOUT_S)
    label = ", ".join(f"{k}={v}" for k, v in case.items())
    times = "; ".join(f"{k} {v * 1e3:.3f} ms" for k, v in result.items() if k.endswith("_s"))
    print(f"  {label}: {result.get('error') or times}", flush=True)
    return result


def _ms(result: dict | None, key: str) -> float | None:
    return None if result is None or key not in result else result[key] * 1e3


def _mb(result: dict | None, key: str) -> float | None:
    return None if result is None or key not in result else result[key] / 2**20


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def run_training(step_list: list[int], windows: list[int | None], reference_limit: int) -> list[dict]:
    raw: dict[tuple, dict] = {}
    for steps in step_list:
        raw[("sdpa", None, steps)] = _measure(_train_case, {"impl": "sdpa", "window": None, "steps": steps})
        for window in windows:
            for impl in ["castle"] + (["reference"] if steps <= reference_limit else []):
                raw[(impl, window, steps)] = _measure(_train_case, {"impl": impl, "window": window, "steps": steps})
    rows = []
    for window in windows:
        for steps in step_list:
            castle = raw[("castle", window, steps)]
            reference = raw.get(("reference", window, steps))
            sdpa = raw[("sdpa", None, steps)]
            half = raw.get(("castle", window, steps // 2))
            rows.append(
                {
                    "variant": _variant(window),
                    "T": steps,
                    "castle fwd ms": _ms(castle, "fwd_s"),
                    "castle f+b ms": _ms(castle, "fb_s"),
                    "castle fwd MB": _mb(castle, "fwd_bytes"),
                    "castle f+b MB": _mb(castle, "fb_bytes"),
                    "ref fwd ms": _ms(reference, "fwd_s"),
                    "ref f+b ms": _ms(reference, "fb_s"),
                    "ref f+b MB": _mb(reference, "fb_bytes"),
                    "sdpa fwd ms": _ms(sdpa, "fwd_s"),
                    "sdpa f+b ms": _ms(sdpa, "fb_s"),
                    "sdpa f+b MB": _mb(sdpa, "fb_bytes"),
                    "castle/sdpa f+b": _ratio(_ms(castle, "fb_s"), _ms(sdpa, "fb_s")),
                    "ref/castle f+b": _ratio(_ms(reference, "fb_s"), _ms(castle, "fb_s")),
                    "mem(T)/mem(T/2)": _ratio(_mb(castle, "fb_bytes"), _mb(half, "fb_bytes")),
                    "errors": "; ".join(
                        f"{name}: {r['error']}"
                        for name, r in (("castle", castle), ("reference", reference), ("sdpa", sdpa))
                        if r is not None and "error" in r
                    )
                    or None,
                }
            )
    return rows


def run_speed_targets(step_list: list[int], rounds: int) -> list[dict]:
    """The speed targets' shape: f+b time and matrix-product FLOPs of CASTLE / CASTLE-SWL vs causal
    SDPA, and of each bf16 op vs its fp32 op, as ratios of times from the same round."""
    rows = []
    for steps in step_list:
        result = run_isolated(_speed_case, {"steps": steps, "rounds": rounds}, timeout=CASE_TIMEOUT_S)
        if "error" in result:
            print(f"  T={steps}: {result['error']}", flush=True)
            continue
        times, flop = result["times"], result["flop"]
        print(
            f"  T={steps}: " + "; ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()),
            flush=True,
        )
        for dtype in TARGET_DTYPES:
            sdpa = times[f"sdpa {dtype}"]
            for window in (None, TARGET_WINDOW):
                name = f"{_variant(window)} {dtype}"
                ratio = paired_ratio(times[name], sdpa)
                fp32 = times[f"{_variant(window)} float32"]
                rows.append(
                    {
                        "variant": _variant(window),
                        "dtype": dtype,
                        "T": steps,
                        "castle f+b ms": statistics.median(times[name]) * 1e3,
                        "sdpa f+b ms": statistics.median(sdpa) * 1e3,
                        "time ratio": ratio["median"],
                        "ratio min": ratio["min"],
                        "ratio max": ratio["max"],
                        "FLOP ratio": _ratio(flop[name], flop[f"sdpa {dtype}"]),
                        "/ fp32 op": None if dtype == "float32" else paired_ratio(times[name], fp32)["median"],
                    }
                )
    return rows


def run_decoding(contexts: list[int]) -> list[dict]:
    """Per context and CASTLE variant: median ms per decoded token, and the medians (with range)
    of its same-round time ratios to the KV-cache SDPA step and, for CASTLE, to the in-place U."""
    rows = []
    for context in contexts:
        result = run_isolated(_decode_case, {"context": context}, timeout=CASE_TIMEOUT_S)
        if "error" in result:
            print(f"  t={context}: {result['error']}", flush=True)
            continue
        times = result["times"]
        per_token = {impl: statistics.median(t) / DECODE_TOKENS * 1e3 for impl, t in times.items()}
        print(f"  t={context}: " + "; ".join(f"{k} {v:.3f} ms/token" for k, v in per_token.items()), flush=True)
        for variant in ("castle", _variant(DECODE_WINDOW)):
            versus_sdpa = paired_ratio(times[variant], times["sdpa"])
            in_place = paired_ratio(times[variant], times["castle-in-place"]) if variant == "castle" else None
            rows.append(
                {
                    "variant": variant,
                    "t": context,
                    "castle ms/token": per_token[variant],
                    "kv-cache sdpa ms/token": per_token["sdpa"],
                    "castle/sdpa": versus_sdpa["median"],
                    "ratio min": versus_sdpa["min"],
                    "ratio max": versus_sdpa["max"],
                    "in-place U ms/token": per_token["castle-in-place"] if in_place else None,
                    "castle/in-place": in_place["median"] if in_place else None,
                }
            )
    return rows


def check_targets(train_rows: list[dict], speed_rows: list[dict], decode_rows: list[dict]) -> list[dict]:
    def find(rows: list[dict], **keys) -> dict | None:
        return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)

    def target(name: str, value: float | None, ok: bool | None, detail: str) -> dict:
        status = "not measured" if ok is None else ("MET" if ok else "NOT MET")
        return {"target": name, "value": value, "status": status, "detail": detail}

    out = []
    big, half = find(train_rows, variant="castle", T=16384), find(train_rows, variant="castle", T=8192)
    mem_ratio = _ratio(big and big["castle f+b MB"], half and half["castle f+b MB"])
    out.append(
        target(
            "f+b peak memory T=16384 / T=8192 <= 2.2",
            mem_ratio,
            None if mem_ratio is None else mem_ratio <= 2.2,
            "castle_attention, B=1 H=1 d=64",
        )
    )
    row = find(train_rows, variant="castle", T=2048)
    speedup = row and row["ref/castle f+b"]
    out.append(
        target(
            "T=2048 f+b >= 20x faster than the O(T^3) reference",
            speedup,
            None if speedup is None else speedup >= 20,
            "reference f+b time / castle_attention f+b time",
        )
    )

    def versus_sdpa(row: dict) -> str:
        return (
            f"B=1 H={TARGET_HEADS} d={HEAD_DIM}; median of same-round ratios, {row['ratio min']:.2f}-"
            f"{row['ratio max']:.2f}; matrix-product FLOP ratio {row['FLOP ratio'] or float('nan'):.2f}"
        )

    for row in speed_rows:
        name = f"{row['variant']} f+b within 3.0x of SDPA causal, T={row['T']} {row['dtype']}"
        out.append(target(name, row["time ratio"], row["time ratio"] <= 3.0, versus_sdpa(row)))
    for row in (r for r in speed_rows if r["variant"] == "castle" and r["T"] == 2048 and r["dtype"] == "bfloat16"):
        name = "castle bf16 f+b within 4.0x of SDPA causal, T=2048"
        out.append(target(name, row["time ratio"], row["time ratio"] <= 4.0, versus_sdpa(row)))
        out.append(
            target(
                "castle bf16 f+b no slower than its fp32 op, T=2048",
                row["/ fp32 op"],
                row["/ fp32 op"] <= 1.0,
                "median of same-round bf16 / fp32 time ratios",
            )
        )
    dec = find(decode_rows, variant="castle", t=8192)
    dec_ratio = dec and dec["castle/sdpa"]
    out.append(
        target(
            "decode at t=8192 within 3.5x of a KV-cache decode step",
            dec_ratio,
            None if dec_ratio is None else dec_ratio <= 3.5,
            f"castle_decode / SDPA KV-cache step, B=1 H={DECODE_HEADS} d={HEAD_DIM}; median of same-round "
            f"ratios, {dec['ratio min']:.2f}-{dec['ratio max']:.2f}"
            if dec
            else "",
        )
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T up to 2048, fewer variants (about a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write all figures to this JSON file")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument(
        "--rounds",
        type=int,
        default=TARGET_ROUNDS,
        help=f"interleaved rounds of the speed targets (default {TARGET_ROUNDS})",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}, not {args.parts!r}")
    step_list = QUICK_STEPS if args.quick else FULL_STEPS
    windows = QUICK_WINDOWS if args.quick else FULL_WINDOWS
    reference_limit = QUICK_REFERENCE_LIMIT if args.quick else FULL_REFERENCE_LIMIT
    contexts = QUICK_DECODE_CONTEXTS if args.quick else FULL_DECODE_CONTEXTS
    start = time.perf_counter()
    machine = machine_description()
    machine["load_average_1min_at_start"] = os.getloadavg()[0]
    print(f"machine: {machine}")
    if machine["load_average_1min_at_start"] > 0.5:
        # Intra-op thread pools wait for descheduled threads, so contention inflates times by
        # far more than the share of CPU taken: run this on an otherwise idle machine.
        print("warning: other processes are using the CPU; the timings below will be inflated")
    train_rows, speed_rows, decode_rows = [], [], []
    if "training" in parts:
        print("training cases (each in a fresh process):", flush=True)
        train_rows = run_training(step_list, windows, reference_limit)
    if "targets" in parts:
        print("speed-target cases:", flush=True)
        speed_rows = run_speed_targets(QUICK_TARGET_STEPS if args.quick else FULL_TARGET_STEPS, args.rounds)
    if "decoding" in parts:
        print("decoding cases:", flush=True)
        decode_rows = run_decoding(contexts)
    targets = check_targets(train_rows, speed_rows, decode_rows)

    if train_rows:
        print(
            f"\ntraining: B=1 H=1 d={HEAD_DIM}, fp32; reference skipped above T={reference_limit} "
            "(O(T^3) time, O(T^2) memory)"
        )
        print(format_table(train_rows, [c for c in train_rows[0] if c != "errors"]))
        for row in train_rows:
            if row["errors"]:
                print(f"  {row['variant']} T={row['T']}: {row['errors']}")
    if speed_rows:
        print(f"\nspeed targets: B=1 H={TARGET_HEADS} d={HEAD_DIM}, CASTLE-SWL with window {TARGET_WINDOW}")
        print(format_table(speed_rows, list(speed_rows[0])))
    if decode_rows:
        print(f"\ndecoding: B=1 H={DECODE_HEADS} d={HEAD_DIM}, fp32, mean over {DECODE_TOKENS} tokens")
        print(format_table(decode_rows, list(decode_rows[0])))
    print("\ntargets:")
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  [{t['status']}] {t['target']}: {value} ({t['detail']})")
    elapsed = time.perf_counter() - start
    print(f"\ntotal {elapsed:.0f} s")
    write_json(
        args.json,
        {
            "machine": machine,
            "quick": args.quick,
            "training": train_rows,
            "speed_targets": speed_rows,
            "target_rounds": args.rounds,
            "decoding": decode_rows,
            "targets": targets,
            "seconds": elapsed,
            "threads": torch.get_num_threads(),
            "head_dim": HEAD_DIM,
        },
    )


if __name__ == "__main__":
    main()
