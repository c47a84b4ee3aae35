"""GPU kernel benchmark: the Triton kernels against causal SDPA (FlashAttention) at training shapes.

    python benchmarks/kernels.py [--quick] [--json PATH] [--parts castle,gca,window] [--peer PATH]

Needs a CUDA GPU; without one it says so and exits 0. bf16, B x T >= 32K tokens per call.
Every case reports forward ("fwd", under no_grad), backward alone ("bwd", the gradient of a
kept graph) and forward+backward ("f+b") wall time (median of several runs), the achieved
TFLOP/s of matrix products, and the CUDA allocator's peak growth of one f+b:

* CASTLE and CASTLE-SWL-512 (H=8, d=64 and 128, B=8 x 4K and B=2 x 16K): `castle_attention`'s
  Triton kernels with the fused backward and with the two-pass one
  (`farsight.ops.castle.triton.BACKWARD`), causal SDPA with the same shapes, and, with --peer, the Triton kernel of the
  `lookahead-keys-attention` package (PATH: its lookahead_keys_attention_triton.py). CASTLE's
  FLOPs are those of the blockwise PyTorch path, counted by torch's FlopCounterMode on meta
  tensors; SDPA's are its 2 forward and 5 backward products over the T(T+1)/2 causal pairs.
  "time/sdpa" over "flop/sdpa" is the fraction of SDPA's rate CASTLE reaches, inverted.
* GCA (the DRT paper's S=64, K=8, H=12, d=64): `gca(backend="triton")` and the PyTorch path;
  FLOPs of the attended pairs ((S+1) x K x S per query chunk, 2 + 5 products), against causal
  SDPA's rate at the same B, T, H, d.
* Sliding-window attention (W=512, H=12, d=64): the CUDA dispatch (FlexAttention) against causal
  SDPA, without and with ALiBi (the models' setting), at FlexAttention tiles of 128 and 64 rows
  (`farsight.ops.window.fused.FLEX_BLOCK_SIZE`); "per pair" compares the time per attended
  (query, key) pair, and "recompiles" counts the graphs torch.compile built while a second
  round of the same calls ran (0: one compile per shape).

The last lines print the tables; --json keeps every figure. Cases that fail show "-" and the error.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from functools import partial

import torch
import torch._dynamo.utils
import torch.nn.functional as F

import farsight.ops.castle.triton as castle_triton
import farsight.ops.window.fused as window_fused
from farsight.eval.efficiency import format_table, machine_description, measure_peak_memory, time_fn, write_json
from farsight.layers.position import alibi_slopes
from farsight.ops.castle import castle_attention
from farsight.ops.gca import gca
from farsight.ops.library import count_flops
from farsight.ops.window import sliding_window_attention

DTYPE = torch.bfloat16
CASTLE_HEADS = 8
GCA_SHAPE = dict(chunk=64, slots=8, heads=12, dim=64)
WINDOW_HEADS, WINDOW_DIM, WINDOW = 12, 64, 512
SDPA_FORWARD_PRODUCTS, SDPA_BACKWARD_PRODUCTS = 2, 5
FULL = dict(
    castle=[(8, 4096), (2, 16384)],
    castle_dims=[64, 128],
    castle_windows=[None, 512],
    gca=[(8, 4096), (2, 16384), (1, 32768)],
    window=[(8, 4096), (2, 16384)],
)
QUICK = dict(castle=[(8, 4096)], castle_dims=[64], castle_windows=[None, 512], gca=[(8, 4096)], window=[(8, 4096)])
# --smoke: tiny shapes that run anywhere (on a CPU the Triton kernels run under TRITON_INTERPRET=1),
# so that the script itself is tested where no GPU is.
SMOKE = dict(castle=[(1, 80)], castle_dims=[16], castle_windows=[None, 20], gca=[(1, 192)], window=[(1, 96)])
DEVICE = torch.device("cuda")
PARTS = ("castle", "gca", "window")


def measure(op: Callable[[], torch.Tensor], inputs: list[torch.Tensor], quick: bool) -> dict:
    """fwd / bwd / f+b median seconds and the f+b peak allocator growth of `op` over `inputs`."""
    device = DEVICE
    repeat = 3 if quick else 5
    result: dict = {}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            result["fwd_s"] = time_fn(op, device, warmup=2, repeat=repeat)
        kept = {"out": op()}  # one graph, differentiated again and again
        grad = torch.randn_like(kept["out"])

        def backward() -> None:
            torch.autograd.grad(kept["out"], inputs, grad, retain_graph=True)

        result["bwd_s"] = time_fn(backward, device, warmup=2, repeat=repeat)
        kept.clear()

        def forward_backward() -> None:
            torch.autograd.grad(op(), inputs, grad)

        result["fb_s"] = time_fn(forward_backward, device, warmup=1, repeat=repeat)
        result["fb_bytes"] = measure_peak_memory(forward_backward, device)
        result["measure_s"] = time.perf_counter() - started  # compilation included
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as exc:  # OOM, or a kernel that failed
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def leaves(shape: tuple[int, ...], count: int) -> list[torch.Tensor]:
    return [torch.randn(shape, device=DEVICE, dtype=DTYPE).requires_grad_(True) for _ in range(count)]


def agreement(
    op: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], inputs: list[torch.Tensor]
) -> float:
    """Largest relative RMS difference between `op` and `reference` over the output and the
    gradients of every input (the same random cotangent for both): a check that the timed kernel
    computes the right thing at the timed shape."""

    def values(fn: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        out = fn()
        grad = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(0), device=out.device)
        return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, inputs, grad.to(out.dtype)))]

    worst = 0.0
    for got, want in zip(values(op), values(reference)):
        worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-30)).item())
    return worst


def rates(result: dict, fwd_flop: float, fb_flop: float) -> dict:
    """ms and TFLOP/s of the fwd, bwd and f+b times in `result`."""
    row: dict = {}
    for part, flop in (("fwd", fwd_flop), ("bwd", fb_flop - fwd_flop), ("f+b", fb_flop)):
        seconds = result.get(part.replace("+", "") + "_s")
        row[f"{part} ms"] = None if seconds is None else seconds * 1e3
        row[f"{part} TF/s"] = None if seconds is None else flop / seconds / 1e12
    row["f+b MB"] = result["fb_bytes"] / 2**20 if "fb_bytes" in result else None
    row["measure s"] = result.get("measure_s")
    row["error"] = result.get("error")
    return row


def sdpa_flop(batch: int, heads: int, steps: int, dim: int) -> tuple[float, float]:
    """(forward, forward+backward) matrix-product FLOPs of causal attention."""
    pairs = batch * heads * steps * (steps + 1) / 2
    return 2 * dim * pairs * SDPA_FORWARD_PRODUCTS, 2 * dim * pairs * (SDPA_FORWARD_PRODUCTS + SDPA_BACKWARD_PRODUCTS)


def causal_sdpa(batch: int, heads: int, steps: int, dim: int, quick: bool) -> dict:
    """The baseline of every part: causal SDPA (FlashAttention where the GPU has it), timed and rated."""
    heads_first = leaves((batch, heads, steps, dim), 3)
    result = measure(partial(F.scaled_dot_product_attention, *heads_first, is_causal=True), heads_first, quick)
    return rates(result, *sdpa_flop(batch, heads, steps, dim))


def castle_flop(batch: int, steps: int, dim: int, window: int | None) -> tuple[float, float]:
    """(forward, forward+backward) matrix-product FLOPs of the blockwise CASTLE path, counted on meta tensors."""
    xs = [torch.randn(batch, steps, CASTLE_HEADS, dim, device="meta", requires_grad=True) for _ in range(6)]
    # count_flops: the torch path is a custom op, which FlopCounterMode alone does not see into
    forward = count_flops(lambda: castle_attention(*xs, window=window, backend="torch"))
    both = count_flops(lambda: castle_attention(*xs, window=window, backend="torch").sum().backward())
    return forward, both


def load_peer(path: str | None) -> Callable | None:
    """The peer package's CASTLE autograd function ([B, H, T, d] q, k, v, qu, ku, vu), or None."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("peer_castle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CastleAttentionFunction.apply


def run_castle(plan: dict, quick: bool, peer: Callable | None) -> list[dict]:
    rows = []
    for dim in plan["castle_dims"]:
        for batch, steps in plan["castle"]:
            xs = leaves((batch, steps, CASTLE_HEADS, dim), 6)
            sdpa = causal_sdpa(batch, CASTLE_HEADS, steps, dim, quick)
            sdpa_fb = sdpa_flop(batch, CASTLE_HEADS, steps, dim)[1]
            rows.append({"case": f"sdpa d={dim} B={batch} T={steps}", **sdpa})
            print(f"  sdpa d={dim} B={batch} T={steps}: {sdpa['f+b ms']} ms", flush=True)
            for window in plan["castle_windows"]:
                variant = "castle" if window is None else f"swl-{window}"
                fwd_f, fb_f = castle_flop(batch, steps, dim, window)
                impls, errors = {}, {}
                torch_path = partial(castle_attention, *xs, window=window, backend="torch")
                for layout in ("fused", "passes"):  # the backward's layout (castle_triton.BACKWARD)
                    castle_triton.BACKWARD = layout
                    op = partial(castle_attention, *xs, window=window, backend="triton")
                    errors[f"triton-{layout}"] = agreement(op, torch_path, xs)
                    impls[f"triton-{layout}"] = measure(op, xs, quick)
                    print(
                        f"  {variant} d={dim} B={batch} T={steps} {layout} backward: triton vs torch path "
                        f"rel. RMS {errors[f'triton-{layout}']:.2e}",
                        flush=True,
                    )
                castle_triton.BACKWARD = "fused"
                if peer is not None and window is None:
                    scale = dim**-0.5
                    peer_inputs = leaves((batch, CASTLE_HEADS, steps, dim), 6)  # q, k, v, qu, ku, vu
                    impls["peer"] = measure(lambda: peer(*peer_inputs, scale, False), peer_inputs, quick)  # noqa: B023
                for name, result in impls.items():
                    row = {"case": f"{variant} d={dim} B={batch} T={steps}", "impl": name, **rates(result, fwd_f, fb_f)}
                    row["flop/sdpa"] = fb_f / sdpa_fb
                    row["time/sdpa"] = _ratio(row["f+b ms"], sdpa["f+b ms"])
                    row["rate vs sdpa"] = _ratio(row["f+b TF/s"], sdpa["f+b TF/s"])
                    row["vs torch path"] = errors.get(name)
                    rows.append(row)
                    print(
                        f"  {row['case']} {name}: {row['f+b ms']} ms, {row['rate vs sdpa']} of SDPA's rate", flush=True
                    )
            del xs
    return rows


def gca_inputs(batch: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """T tokens as T/S query chunks of S+1 rows, each retrieving K earlier chunks (empty slots for
    the first chunks), weights softmaxed."""
    s, n_slots, heads, dim = (GCA_SHAPE[k] for k in ("chunk", "slots", "heads", "dim"))
    n = steps // s
    q = torch.randn(batch, n, s + 1, heads, dim, device=DEVICE, dtype=DTYPE).requires_grad_(True)
    k, v = (torch.randn(batch, n, s, heads, dim, device=DEVICE, dtype=DTYPE).requires_grad_(True) for _ in range(2))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scores = torch.rand(batch, n, n, device=DEVICE, generator=gen).masked_fill(
        torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(), -1.0
    )
    top = scores.topk(min(n_slots, n), dim=-1)
    index = torch.where(top.values >= 0, top.indices, -1)
    if index.shape[-1] < n_slots:
        index = F.pad(index, (0, n_slots - index.shape[-1]), value=-1)
    weight = torch.rand(batch, n, n_slots, device=DEVICE).softmax(-1).requires_grad_(True)
    return [q, k, v, weight], index.contiguous()


def run_gca(plan: dict, quick: bool) -> list[dict]:
    s, n_slots, heads, dim = (GCA_SHAPE[k] for k in ("chunk", "slots", "heads", "dim"))
    rows = []
    for batch, steps in plan["gca"]:
        (q, k, v, weight), index = gca_inputs(batch, steps)
        pairs = float((index >= 0).sum()) * (s + 1) * s * heads
        fwd_f, fb_f = (
            2 * dim * pairs * SDPA_FORWARD_PRODUCTS,
            2 * dim * pairs * (SDPA_FORWARD_PRODUCTS + SDPA_BACKWARD_PRODUCTS),
        )
        sdpa = causal_sdpa(batch, heads, steps, dim, quick)
        error = agreement(
            partial(gca, q, k, v, index, weight, backend="triton"),
            partial(gca, q, k, v, index, weight, backend="torch"),
            [q, k, v, weight],
        )
        print(f"  gca B={batch} T={steps}: triton vs torch path rel. RMS {error:.2e}", flush=True)
        for impl in ("triton", "torch"):
            result = measure(partial(gca, q, k, v, index, weight, backend=impl), [q, k, v, weight], quick)
            row = {"case": f"B={batch} T={steps}", "impl": impl, **rates(result, fwd_f, fb_f)}
            row["sdpa f+b TF/s"] = sdpa["f+b TF/s"]
            row["rate vs sdpa"] = _ratio(row["f+b TF/s"], sdpa["f+b TF/s"])
            row["vs torch path"] = error if impl == "triton" else None
            rows.append(row)
            print(f"  gca {row['case']} {impl}: {row['f+b ms']} ms, {row['rate vs sdpa']} of SDPA's rate", flush=True)
        del q, k, v, weight, index
    return rows


def run_window(plan: dict, quick: bool) -> list[dict]:
    rows = []
    for batch, steps in plan["window"]:
        q, k, v = leaves((batch, steps, WINDOW_HEADS, WINDOW_DIM), 3)
        slopes = alibi_slopes(WINDOW_HEADS).to(q.device)
        sdpa = causal_sdpa(batch, WINDOW_HEADS, steps, WINDOW_DIM, quick)
        sdpa_f, sdpa_fb = sdpa_flop(batch, WINDOW_HEADS, steps, WINDOW_DIM)
        # attended pairs: query t sees its last min(t + 1, W) positions, itself included
        pairs = sum(min(t + 1, WINDOW) for t in range(steps)) / (steps * (steps + 1) / 2)
        for alibi in (False, True):
            for block in (128, 64):
                window_fused.FLEX_BLOCK_SIZE = block
                op = partial(sliding_window_attention, q, k, v, WINDOW, slopes if alibi else None)
                result = measure(op, [q, k, v], quick)
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                measure(op, [q, k, v], True)  # the same calls again: nothing new to compile
                recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
                case = f"W={WINDOW}{' alibi' if alibi else ''} B={batch} T={steps}"
                row = {"case": case, "impl": f"flex-{block}", **rates(result, sdpa_f * pairs, sdpa_fb * pairs)}
                row["sdpa f+b ms"] = sdpa["f+b ms"]
                row["pairs/sdpa"] = pairs
                row["per pair vs sdpa"] = _ratio(
                    row["f+b ms"], None if sdpa["f+b ms"] is None else sdpa["f+b ms"] * pairs
                )
                row["recompiles"] = recompiles
                rows.append(row)
                print(
                    f"  window {case} tiles {block}: {row['f+b ms']} ms, per pair {row['per pair vs sdpa']}x SDPA, "
                    f"{recompiles} recompiles",
                    flush=True,
                )
        window_fused.FLEX_BLOCK_SIZE = 128
        del q, k, v
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if rows:
        columns = list(dict.fromkeys(c for row in rows for c in row if c != "error"))
        print(format_table(rows, columns))
        for row in rows:
            if row.get("error"):
                print(f"  {row['case']} {row.get('impl', '')}: {row['error']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape per op, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write all figures to this JSON file")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--peer", metavar="PATH", help="lookahead_keys_attention_triton.py of the peer package")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device (checks the script, times nothing useful)"
    )
    parser.add_argument("--shapes", metavar="BxT,...", help="batch x length of every part's cases, e.g. 8x4096,2x16384")
    parser.add_argument("--castle-dims", metavar="D,...", help="CASTLE head dims (default 64,128)")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    machine = machine_description()
    global DEVICE
    if not torch.cuda.is_available():
        if not args.smoke:
            reason = (
                "no CUDA GPU: the kernel benchmark needs one (the Triton kernels are only interpreter-tested on CPU)"
            )
            print(f"skipped: {reason}")
            write_json(args.json, {"machine": machine, "skipped": reason})
            return 0
        DEVICE = torch.device("cpu")
    import triton

    machine.update(triton=triton.__version__, cuda=torch.version.cuda)
    print(f"machine: {machine}", flush=True)
    plan = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
        plan.update(castle=shapes, gca=shapes, window=shapes)
    if args.castle_dims:
        plan["castle_dims"] = [int(d) for d in args.castle_dims.split(",")]
    start = time.perf_counter()
    results: dict = {"machine": machine, "quick": args.quick, "dtype": str(DTYPE)}
    runners = {
        "castle": lambda: run_castle(plan, args.quick, load_peer(args.peer)),
        "gca": lambda: run_gca(plan, args.quick),
        "window": lambda: run_window(plan, args.quick),
    }
    for part in parts:
        print(f"{part}:", flush=True)
        results[part] = runners[part]()
        write_json(args.json, results)  # after each part: a run cut short keeps what it measured
    s, n_slots, heads, dim = (GCA_SHAPE[k] for k in ("chunk", "slots", "heads", "dim"))
    print_table(f"CASTLE (H={CASTLE_HEADS}, bf16); TF/s counts matrix-product FLOPs", results.get("castle", []))
    print_table(f"GCA (S={s}, K={n_slots}, H={heads}, d={dim}, bf16)", results.get("gca", []))
    print_table(f"sliding window (H={WINDOW_HEADS}, d={WINDOW_DIM}, bf16)", results.get("window", []))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
