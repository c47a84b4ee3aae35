"""Static resource report of the Triton kernels: compiled for a GPU target on any machine (no GPU
needed), with the registers, spilled bytes, local loads/stores and matrix instructions of each.

    python benchmarks/kernel_resources.py [--dtype bf16] [--dims 64,128] [--arch 90] [--float-type fp64] [--first-launch]

Spills are what a GPU run cannot show cheaply and what these kernels' speed hangs on: a kernel
whose tiles do not fit its registers keeps them in local memory (LDL/STL in the machine code).
Triton compiles for `--arch` (90: Hopper, sm_90a) with its own ptxas and reads the cubin with
the cuobjdump it ships. The figures depend on the Triton version (printed), so compare them
within one version; `pip install --target DIR triton==X` and PYTHONPATH=DIR reports another.

Float scalars (`scale`) are typed fp32, as Triton's own launcher passes a Python float; inside a
torch.compile'd graph, Inductor launches the kernels with them typed fp64, and `--float-type fp64`
compiles that variant (a kernel whose loop-carried values would turn fp64 fails to compile).
`--first-launch` compiles only each kernel's first listed launch setting. Exits non-zero when a
kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import farsight.ops.castle.triton as castle_kernels
import farsight.ops.gca.triton as gca_kernels
from farsight.eval.efficiency import format_table

# argument name -> Triton type, per kernel family; other scalars are i32
POINTER_DTYPE_ARGS = ("QU", "KU", "VU", "QC", "KC", "VC", "Snap", "dO", "dQU", "dKC", "dVC", "Q", "K", "V", "Out", "dQ")
FP32_ARGS = ("Dsum", "Lse", "Acc", "M", "L", "Delta", "dQC", "dVU", "dKU", "Weight", "dK", "dV", "dWPart", "RowTerm")
INT64_ARGS = ("KeyMask", "Index", "Slots", "Offsets")
INT32_ARGS = ("DocStart", "DocEnd")  # CASTLE's per-token document bounds (packed rows)


def signature(fn, dtype: str, constexprs: dict, float_type: str = "fp32") -> dict:
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in POINTER_DTYPE_ARGS:
            return f"*{dtype}"
        if name in FP32_ARGS:
            return "*fp32"
        if name in INT64_ARGS:
            return "*i64"
        if name in INT32_ARGS:
            return "*i32"
        return float_type if name == "scale" else "i32"

    return {name: kind(name) for name in fn.arg_names}


def resources(
    kernel, dtype: str, constexprs: dict, warps: int, stages: int, arch: int, float_type: str = "fp32"
) -> dict:
    fn = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn
    source = ASTSource(
        fn=fn,
        signature=signature(fn, dtype, constexprs, float_type),
        constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
    )
    start = time.perf_counter()
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    seconds = time.perf_counter() - start
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True)
        sass = subprocess.run([f"{tools}/cuobjdump", "--dump-sass", cubin], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage.stdout))
    return {
        "registers": int(fields.get("REG", 0)),
        "stack bytes": int(fields.get("STACK", 0)),
        "local loads": sass.count("LDL"),
        "local stores": sass.count("STL"),
        "wgmma": sass.count("HGMMA"),
        "mma": sass.count("HMMA"),
        "compile s": seconds,
    }


def cases(dim: int) -> list[tuple[str, object, dict, list[tuple[int, int]]]]:
    block = 64 if dim <= 64 else 32
    castle = dict(HAS_WINDOW=False, HAS_DOCS=False, PREC="ieee", BLOCK=block, BLOCK_D=dim)
    castle_backward = {**castle, "BLOCK": castle_kernels.backward_block(block, dim)}
    gca = dict(HAS_KEY_MASK=False, DOT_PRECISION="ieee", BLOCK_Q=64, TAIL=16, BLOCK_S=64, BLOCK_D=dim)
    return [
        ("castle forward: lookahead", castle_kernels._castle_fwd_lookahead_kernel, castle, [(4, 2), (8, 2)]),
        ("castle forward: attend", castle_kernels._castle_fwd_attend_kernel, castle, [(4, 2), (8, 2)]),
        ("castle forward: diagonal", castle_kernels._castle_fwd_diag_kernel, castle, [(4, 1)]),
        ("castle backward", castle_kernels._castle_bwd_kernel, castle_backward, [(4, 1), (8, 1)]),
        ("gca forward", gca_kernels._gca_fwd_kernel, {**gca, "SOFTMAX_ONE": True}, [(4, 2), (8, 2)]),
        ("gca backward, atomic", gca_kernels._gca_bwd_kernel, {**gca, "ONE_TILE": True, "KEY_GRADS": True}, [(4, 2)]),
        ("gca backward, rows", gca_kernels._gca_bwd_kernel, {**gca, "ONE_TILE": True, "KEY_GRADS": False}, [(8, 2)]),
        ("gca backward, dk/dv", gca_kernels._gca_bwd_kv_kernel, gca, [(8, 2)]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--dims", default="64,128", help="head dims (comma-separated)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument(
        "--float-type",
        default="fp32",
        choices=["fp32", "fp64"],
        help="type of float scalars (fp64: as under torch.compile)",
    )
    parser.add_argument("--first-launch", action="store_true", help="only each kernel's first launch setting")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the report compiles the kernels for a GPU")
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        for name, kernel, constexprs, launches in cases(dim):
            for warps, stages in launches[:1] if args.first_launch else launches:
                row = {"kernel": name, "d": dim, "block": constexprs.get("BLOCK", constexprs.get("BLOCK_Q"))}
                row.update(warps=warps, stages=stages)
                row.update(resources(kernel, args.dtype, constexprs, warps, stages, args.arch, args.float_type))
                rows.append(row)
                print(f"  {name} d={dim} {warps} warps {stages} stages: {row['stack bytes']} stack bytes", flush=True)
    print(
        f"\nTriton {triton.__version__}, sm_{args.arch}, {args.dtype} inputs, {args.float_type} scalars; "
        "spills = stack bytes, local loads/stores"
    )
    print(format_table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
