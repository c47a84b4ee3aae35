"""GPU kernel benchmark: Triton kernels against the PyTorch paths and FlashAttention-2 / SDPA.

    python benchmarks/kernels.py [--quick] [--json PATH]

Needs a CUDA GPU; on a machine without one it says so and exits 0 (nothing is measured).
For every case it reports forward ("fwd", under no_grad) and forward+backward ("f+b") wall time
(median of several runs) and the CUDA allocator's peak growth of one call, in bf16:

* GCA (paper shapes S=64, K=8, H=12, d=64; T tokens = T/S query chunks of S rows, each
  retrieving K earlier chunks): `gca(backend="triton")` vs `gca(backend="torch")`.
* CASTLE / CASTLE-SWL (H=8, d=64 and 128, T up to 16K): `castle_attention(backend="triton")`
  vs the blockwise torch path vs SDPA causal attention (FlashAttention-2 where the GPU has it)
  with the same H and d.
* Sliding-window attention (H=12, d=64): `sliding_window_attention` with backend "auto"
  (FlexAttention on CUDA) and "blockwise" vs full causal SDPA.

Cases that run out of memory show "-" and the error below the table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from farsight.eval.efficiency import format_table, machine_description, measure_peak_memory, time_fn, write_json
from farsight.ops.castle import castle_attention
from farsight.ops.gca import gca
from farsight.ops.window import sliding_window_attention

DTYPE = torch.bfloat16
GCA_SHAPE = dict(chunk=64, slots=8, heads=12, dim=64)
CASTLE_HEADS = 8
WINDOW_HEADS, WINDOW_DIM = 12, 64
FULL = dict(
    gca_steps=[4096, 8192, 16384, 32768],
    castle_dims=[64, 128],
    castle_steps=[1024, 2048, 4096, 8192, 16384],
    castle_windows=[None, 512],
    window_steps=[4096, 8192, 16384, 32768],
    window_sizes=[512, 2048],
)
QUICK = dict(
    gca_steps=[4096, 8192],
    castle_dims=[64],
    castle_steps=[1024, 4096],
    castle_windows=[None, 512],
    window_steps=[4096],
    window_sizes=[512],
)


def measure(op: Callable[[], torch.Tensor], quick: bool) -> dict:
    """fwd / f+b median seconds and peak allocator growth in bytes of `op` (a closure over leaves)."""
    device = torch.device("cuda")
    holder: dict[str, torch.Tensor] = {}

    def forward() -> None:
        with torch.no_grad():
            op()

    def forward_backward() -> None:
        out = op()
        if "grad" not in holder:
            holder["grad"] = torch.randn_like(out)
        out.backward(holder["grad"])

    repeat = 3 if quick else 5
    result: dict = {}
    try:
        result["fwd_s"] = time_fn(forward, device, warmup=2, repeat=repeat)
        result["fwd_bytes"] = measure_peak_memory(forward, device)
        result["fb_s"] = time_fn(forward_backward, device, warmup=2, repeat=repeat)
        result["fb_bytes"] = measure_peak_memory(forward_backward, device)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # OOM, or a kernel that failed
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        holder.clear()
        torch.cuda.empty_cache()
    return result


def leaves(shape: tuple[int, ...], count: int) -> list[torch.Tensor]:
    return [torch.randn(shape, device="cuda", dtype=DTYPE).requires_grad_(True) for _ in range(count)]


def _ms(r: dict, key: str) -> float | None:
    return r[key] * 1e3 if key in r else None


def _mb(r: dict, key: str) -> float | None:
    return r[key] / 2**20 if key in r else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _errors(results: dict[str, dict]) -> str | None:
    return "; ".join(f"{name}: {r['error']}" for name, r in results.items() if "error" in r) or None


def _report(label: str, results: dict[str, dict]) -> None:
    parts = []
    for name, r in results.items():
        parts.append(f"{name} " + (r["error"] if "error" in r else f"{r['fwd_s'] * 1e3:.2f}/{r['fb_s'] * 1e3:.2f} ms"))
    print(f"  {label}: " + "; ".join(parts), flush=True)


def gca_inputs(batch: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    s, n_slots, heads, dim = (GCA_SHAPE[k] for k in ("chunk", "slots", "heads", "dim"))
    n = steps // s
    q, k, v = leaves((batch, n, s, heads, dim), 3)
    # Query chunk t retrieves K distinct earlier chunks (-1 while fewer than K exist).
    scores = torch.rand(n, n, device="cuda").masked_fill(torch.ones(n, n, device="cuda").triu().bool(), -1.0)
    top = scores.topk(min(n_slots, n), dim=-1)
    index = torch.where(top.values >= 0, top.indices, -1)
    if index.shape[-1] < n_slots:
        index = F.pad(index, (0, n_slots - index.shape[-1]), value=-1)
    weight = torch.rand(batch, n, n_slots, device="cuda", dtype=DTYPE).softmax(-1).requires_grad_(True)
    return [q, k, v, weight], index.expand(batch, n, n_slots).contiguous()


def run_gca(batch: int, steps_list: list[int], quick: bool) -> list[dict]:
    rows = []
    for steps in steps_list:
        (q, k, v, weight), index = gca_inputs(batch, steps)
        results = {}
        for backend in ("triton", "torch"):
            results[backend] = measure(partial(gca, q, k, v, index, weight, backend=backend), quick)
        _report(f"gca T={steps}", results)
        tri, tor = results["triton"], results["torch"]
        rows.append(
            {
                "T": steps,
                "triton fwd ms": _ms(tri, "fwd_s"),
                "torch fwd ms": _ms(tor, "fwd_s"),
                "triton f+b ms": _ms(tri, "fb_s"),
                "torch f+b ms": _ms(tor, "fb_s"),
                "triton f+b MB": _mb(tri, "fb_bytes"),
                "torch f+b MB": _mb(tor, "fb_bytes"),
                "torch/triton f+b": _ratio(_ms(tor, "fb_s"), _ms(tri, "fb_s")),
                "errors": _errors(results),
            }
        )
        del q, k, v, weight, index
    return rows


def run_castle(
    batch: int, dims: list[int], steps_list: list[int], windows: list[int | None], quick: bool
) -> list[dict]:
    rows = []
    for dim in dims:
        for steps in steps_list:
            xs = leaves((batch, steps, CASTLE_HEADS, dim), 6)
            qkv = leaves((batch, CASTLE_HEADS, steps, dim), 3)
            sdpa = measure(partial(F.scaled_dot_product_attention, *qkv, is_causal=True), quick)
            for window in windows:
                results = {}
                for backend in ("triton", "torch"):
                    results[backend] = measure(partial(castle_attention, *xs, window=window, backend=backend), quick)
                results["sdpa"] = sdpa
                variant = "castle" if window is None else f"swl-{window}"
                _report(f"{variant} d={dim} T={steps}", results)
                tri, tor = results["triton"], results["torch"]
                rows.append(
                    {
                        "variant": variant,
                        "d": dim,
                        "T": steps,
                        "triton fwd ms": _ms(tri, "fwd_s"),
                        "triton f+b ms": _ms(tri, "fb_s"),
                        "torch fwd ms": _ms(tor, "fwd_s"),
                        "torch f+b ms": _ms(tor, "fb_s"),
                        "sdpa fwd ms": _ms(sdpa, "fwd_s"),
                        "sdpa f+b ms": _ms(sdpa, "fb_s"),
                        "triton f+b MB": _mb(tri, "fb_bytes"),
                        "torch f+b MB": _mb(tor, "fb_bytes"),
                        "sdpa f+b MB": _mb(sdpa, "fb_bytes"),
                        "triton/sdpa fwd": _ratio(_ms(tri, "fwd_s"), _ms(sdpa, "fwd_s")),
                        "triton/sdpa f+b": _ratio(_ms(tri, "fb_s"), _ms(sdpa, "fb_s")),
                        "torch/triton f+b": _ratio(_ms(tor, "fb_s"), _ms(tri, "fb_s")),
                        "errors": _errors(results),
                    }
                )
            del xs, qkv
    return rows


def run_window(batch: int, steps_list: list[int], sizes: list[int], quick: bool) -> list[dict]:
    rows = []
    for steps in steps_list:
        q, k, v = leaves((batch, steps, WINDOW_HEADS, WINDOW_DIM), 3)
        heads_first = [x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v)]
        sdpa = measure(partial(F.scaled_dot_product_attention, *heads_first, is_causal=True), quick)
        for window in sizes:
            results = {}
            for backend in ("auto", "blockwise"):
                results[backend] = measure(partial(sliding_window_attention, q, k, v, window, backend=backend), quick)
            results["sdpa causal"] = sdpa
            _report(f"window={window} T={steps}", results)
            auto, blockwise = results["auto"], results["blockwise"]
            rows.append(
                {
                    "W": window,
                    "T": steps,
                    "auto fwd ms": _ms(auto, "fwd_s"),
                    "auto f+b ms": _ms(auto, "fb_s"),
                    "blockwise f+b ms": _ms(blockwise, "fb_s"),
                    "sdpa causal f+b ms": _ms(sdpa, "fb_s"),
                    "auto f+b MB": _mb(auto, "fb_bytes"),
                    "blockwise f+b MB": _mb(blockwise, "fb_bytes"),
                    "auto/sdpa f+b": _ratio(_ms(auto, "fb_s"), _ms(sdpa, "fb_s")),
                    "blockwise/auto f+b": _ratio(_ms(blockwise, "fb_s"), _ms(auto, "fb_s")),
                    "errors": _errors(results),
                }
            )
        del q, k, v, heads_first
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if not rows:
        return
    print(format_table(rows, [c for c in rows[0] if c != "errors"]))
    for row in rows:
        if row["errors"]:
            print(f"  T={row['T']}: {row['errors']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and shorter cases")
    parser.add_argument("--json", metavar="PATH", help="also write all figures to this JSON file")
    parser.add_argument("--batch", type=int, default=1, help="batch size B of every case (default 1)")
    args = parser.parse_args()
    machine = machine_description()
    print(f"machine: {machine}")
    if not torch.cuda.is_available():
        reason = "no CUDA GPU: the kernel benchmark needs one (the Triton kernels are only interpreter-tested on CPU)"
        print(f"skipped: {reason}")
        write_json(args.json, {"machine": machine, "quick": args.quick, "skipped": reason})
        return 0
    plan = QUICK if args.quick else FULL
    start = time.perf_counter()
    print(f"dtype {DTYPE}; each entry: fwd/f+b ms", flush=True)
    print("GCA:", flush=True)
    gca_rows = run_gca(args.batch, plan["gca_steps"], args.quick)
    print("CASTLE:", flush=True)
    castle_rows = run_castle(args.batch, plan["castle_dims"], plan["castle_steps"], plan["castle_windows"], args.quick)
    print("sliding window:", flush=True)
    window_rows = run_window(args.batch, plan["window_steps"], plan["window_sizes"], args.quick)

    s, n_slots, heads, dim = (GCA_SHAPE[k] for k in ("chunk", "slots", "heads", "dim"))
    b = args.batch
    print_table(f"GCA: B={b}, S={s}, K={n_slots}, H={heads}, d={dim}, T/S query chunks of S rows", gca_rows)
    print_table(f"CASTLE: B={b}, H={CASTLE_HEADS}; sdpa = causal SDPA with the same H and d", castle_rows)
    print_table(f"sliding window: B={b}, H={WINDOW_HEADS}, d={WINDOW_DIM}; auto = the CUDA dispatch", window_rows)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    write_json(
        args.json,
        {
            "machine": machine,
            "quick": args.quick,
            "batch": args.batch,
            "dtype": str(DTYPE),
            "gca": gca_rows,
            "castle": castle_rows,
            "window": window_rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
