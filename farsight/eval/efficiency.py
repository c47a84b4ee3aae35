"""Timing and peak-memory measurement shared by the benchmarks and `farsight eval bench`.

On CPU the peak is the growth of the resident set's high-water mark over the memory in use when
the measured call starts (the freed heap is trimmed and the mark reset first, on Linux); each
case runs in a fresh spawned process so that cases do not share a heap. On CUDA the
allocator's own peak counter is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farsight.files import atomic_write, new_folders_for, reported_write
from farsight.process_memory import current_rss_bytes, peak_rss_bytes, release_freed_memory, reset_peak_rss, tune_malloc
from farsight.train.precision import flush_denormals, resolve_precision

logger = logging.getLogger(__name__)


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(
    fn: Callable[[], Any],
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeat: int = 3,
    min_seconds: float = 0.0,
) -> float:
    """Median wall time of `fn()` in seconds over `repeat` runs (more while under `min_seconds`)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(
    fns: dict[str, Callable[[], Any]], device: torch.device | str = "cpu", warmup: int = 1, rounds: int = 5
) -> dict[str, list[float]]:
    """Wall times in seconds of every `fns` entry, round by round: {name: [round 0, round 1, ...]}.

    Each round calls every function once, the order rotated by one place per round, so that a
    shared host's slow and fast spells fall on all of them alike: the ratio of two functions'
    times in the same round (`paired_ratio`) then holds still where their separate medians
    move by more than the difference being measured.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Median, lowest and highest of numerator[i] / denominator[i] over the rounds of
    `time_interleaved`: {"median", "min", "max"}."""
    if not numerator or len(numerator) != len(denominator):
        raise ValueError(
            f"paired_ratio needs two equally long, non-empty lists, got {len(numerator)} and {len(denominator)}"
        )
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def training_step(
    model: nn.Module, ids: torch.Tensor, precision: str = "fp32", widen: bool = True, compile: bool = False
) -> Callable[[], None]:
    """One AdamW step (lr 1e-4) of `model` on `ids` [B, T] as their own labels, as the trainer
    takes it: in precision `precision` (train.precision.MODES: parameters cast, autocast around
    the forward, loss scaling for fp16), a loss-only forward (the chunked loss for large
    vocabularies), AdamW's fused kernel on a CPU, denormals flushed on a CPU
    (`flush_denormals`) and, with `compile`, the blocks and the loss compiled
    (`farsight.train.compile`; on the first call). With `widen` the bf16/fp16 products of a CPU
    without matrix instructions for them run as fp32 GEMMs as the trainer runs them
    (widen=False keeps torch's own kernels: the baseline that measures what widening buys). The
    optimizer state is allocated on the first call."""
    from farsight.train.compile import compile_model

    device = ids.device
    mode = resolve_precision(precision, device)
    mode.cast_parameters(model)
    kernel = {"fused": True} if device.type == "cpu" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kernel)
    scaler = mode.grad_scaler(device)
    if compile:
        compile_model(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with flush_denormals(device), mode.matmuls(device) if widen else contextlib.nullcontext():
            with mode.autocast(device):
                loss = model(ids, labels=ids, return_logits=False).loss
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()

    return step


def measure_peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated by `fn()` above what was in use when it started.

    On CPU without a resettable high-water mark (not Linux) this only holds in a process that
    has not yet reached a higher peak, which is what `run_isolated` provides.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    release_freed_memory()
    base = current_rss_bytes() if reset_peak_rss() else max(current_rss_bytes(), peak_rss_bytes())
    fn()
    return max(0, peak_rss_bytes() - base)


def _isolated_entry(target: Callable[[dict], dict], case: dict, conn, default_malloc: bool) -> None:
    try:
        if not default_malloc:
            tune_malloc()
        conn.send(("ok", target(case)))
    except BaseException as exc:  # report any failure (including MemoryError) to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_isolated(
    target: Callable[[dict], dict], case: dict, timeout: float | None = None, default_malloc: bool = False
) -> dict:
    """Run `target(case)` in a fresh spawned process and return its result dict.

    The process runs with farsight's malloc settings (`tune_malloc`), as the command line does,
    or with glibc's defaults when `default_malloc` (a benchmark's baseline).

    `target` must be a module-level function. Failures come back as {"error": message} so a
    benchmark table can show "out of memory" or "timeout" instead of aborting the whole run.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_isolated_entry, args=(target, case, child, default_malloc))
    proc.start()
    child.close()
    if not parent.poll(timeout):
        proc.kill()
        proc.join()
        return {"error": f"timeout after {timeout:.0f}s"}
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        return {"error": f"worker died (exit code {proc.exitcode}; out of memory?)"}
    proc.join()
    return payload if status == "ok" else {"error": payload}


def format_table(rows: list[dict], columns: list[str], markdown: bool = False) -> str:
    """Plain-text table with right-aligned columns, or a Markdown one; floats get 4 significant digits."""

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    if markdown:
        return "\n".join("| " + " | ".join(row) + " |" for row in [columns, ["---"] * len(columns), *cells])
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _write_text(path: Path, text: str) -> None:
    """Write text to path: parent folders made as needed, atomically (a failed write leaves an
    earlier file as it was)."""
    with new_folders_for(path), reported_write(path):
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    logger.info(f"wrote {path}")


def write_json(path: str | os.PathLike | None, payload: dict, default: Callable[[Any], Any] | None = None) -> None:
    """Write payload as indented JSON (parent folders made as needed; atomically, so a failed
    write leaves an earlier file as it was); nothing when path is None. `default` serialises
    what json cannot (json.dumps's argument)."""
    if path:
        _write_text(Path(path), json.dumps(payload, indent=2, default=default) + "\n")


def write_json_lines(
    path: str | os.PathLike, records: Iterable[dict], default: Callable[[Any], Any] | None = None
) -> None:
    """Write records as JSON lines, one object a line, as write_json writes (atomically)."""
    _write_text(Path(path), "".join(json.dumps(record, default=default) + "\n" for record in records))


def machine_description() -> dict:
    import platform

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
