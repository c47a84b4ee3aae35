"""What flushing denormals on every CPU thread buys over flushing them on the calling thread only.

    python benchmarks/denormals.py [--repeat 5] [--steps baselm,drt-x1] [--d-model 256] [--json PATH]

torch.set_flush_denormal sets a register of the calling thread, while most of a kernel's work
runs on the other threads of torch's OpenMP pool; `farsight.train.precision.flush_denormals`
sets it on every one of them. Each case here is timed under both, taking turns call by call in
one process (median of --repeat calls each; the speed-up is the median of the ratios of calls
from the same round): "caller" is torch.set_flush_denormal on the calling
thread alone, "every thread" is flush_denormals. The cases, fp32:

- bmm: softmax probabilities [64, 1024, 1024] of scores with a spread of 40 (about 11% of them
  denormal) times values [64, 1024, 64];
- window: sliding-window attention with ALiBi (B=4, T=4096, H=4, d=64, W=512; the slopes
  2^-2 ... 2^-8 put the scores 348-412 tokens back in the first head between 87 and 103 below
  the row's maximum), forward and backward;
- step: a full AdamW step of benchmarks/train_throughput.py's models (`--utilisation`'s, 8
  layers) at --d-model, 4 x 4096 tokens (farsight.eval.efficiency.training_step).

Denormal arithmetic costs differ by CPU (microcode assists on Intel cores), so run it on the host
you train on.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch
from train_throughput import util_model  # the benchmarks' folder is the script's, on sys.path

from farsight.eval.efficiency import (
    format_table,
    machine_description,
    paired_ratio,
    time_interleaved,
    training_step,
    write_json,
)
from farsight.ops.window import sliding_window_attention
from farsight.process_memory import tune_malloc
from farsight.train import precision

CPU = torch.device("cpu")


@contextlib.contextmanager
def caller_only() -> Iterator[None]:
    """flush_denormals as torch.set_flush_denormal alone gives it: the calling thread only. The
    training step enters flush_denormals itself, so the pool is hidden from it rather than left
    unflushed around it."""
    entries = precision._openmp_parallel_entries
    precision._openmp_parallel_entries = lambda: ()
    try:
        with precision.flush_denormals(CPU):
            yield
    finally:
        precision._openmp_parallel_entries = entries


MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "caller": caller_only,
    "every thread": lambda: precision.flush_denormals(CPU),
}


def bmm_case() -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(40 * torch.randn(64, 1024, 1024, generator=generator), dim=-1)
    values = torch.randn(64, 1024, 64, generator=generator)
    return lambda: torch.bmm(probs, values)


def window_case() -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4096, 4, 64, generator=generator).requires_grad_() for _ in range(3))
    slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    grad = torch.randn(4, 4096, 4, 64, generator=generator)

    def run() -> None:
        for x in (q, k, v):
            x.grad = None
        sliding_window_attention(q, k, v, 512, alibi_slopes=slopes).backward(grad)

    return run


def step_case(model: str, d_model: int) -> Callable[[], None]:
    ids = torch.randint(0, 256, (4, 4096), generator=torch.Generator().manual_seed(0))
    return training_step(util_model(model, d_model), ids, "fp32")


def measure(name: str, fn: Callable[[], None], repeat: int) -> dict:
    """Median seconds of fn() under each mode, the modes taking turns call by call
    (time_interleaved), and the speed-up as the median of the same-round ratios."""

    def under(context: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def run() -> None:
            with context():
                fn()

        return run

    # one untimed call each first: kernels, pools, the heap
    times = time_interleaved({mode: under(context) for mode, context in MODES.items()}, warmup=1, rounds=repeat)
    row = {"case": name, **{f"{mode} ms": 1e3 * statistics.median(t) for mode, t in times.items()}}
    row["speed-up"] = paired_ratio(times["caller"], times["every thread"])["median"]
    print(format_table([row], list(row)), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", default="baselm,drt-x1", help="models whose training step to time ('' for none)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    tune_malloc()
    print(f"threads: {torch.get_num_threads()}, OpenMP runtimes reached: {len(precision._openmp_parallel_entries())}")
    cases = [("bmm", bmm_case), ("window f+b", window_case)]
    cases += [(f"{m} step d{args.d_model}", lambda m=m: step_case(m, args.d_model)) for m in args.steps.split(",") if m]
    rows = [measure(name, make(), args.repeat) for name, make in cases]
    print("\n" + format_table(rows, list(rows[0])))
    write_json(args.json, {"machine": machine_description(), "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
