#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (CI has none), run natively on a GPU machine from the
# repository root, with a Python that has torch (CUDA), triton and farsight's core dependencies:
#
#   bash experiments/gpu-check.sh [OUT_DIR]            # all parts
#   PARTS="3 4" bash experiments/gpu-check.sh [OUT_DIR] # some of them, in that order
#
# Each part writes its log into OUT_DIR as it goes (a machine lent for minutes may be taken
# back before the end):
# 1. The quick CUDA tests: tests/models/test_cuda.py (every model kind on the GPU against the
#    CPU, and compiled against eager) and tests/ops/test_autocast.py (every op backend under autocast and in pure bf16):
#    about 25 s on an H200. OUT_DIR/tests-cuda.log.
# 2. `farsight train` on the GPU in bf16-mixed, 40 steps (TRAIN_STEPS) of 8 x 2048 and 2 x 8192
#    tokens (TRAIN_SHAPES), d_model 512, 8 layers, for causal attention, CASTLE with each
#    backward layout (castle, castle-passes), BaseLM and DRT x2 (TRAIN_KINDS): the median
#    tokens/s of the logged steps after the first ten and each one's ratio to causal in
#    OUT_DIR/train-summary.txt (OUT_DIR/train-KIND-SHAPE.log hold the trainer's output).
#    A dry run on a CPU: TRAIN_DEVICE=cpu TRAIN_SHAPES=1x128 TRAIN_STEPS=15.
# 3. The Triton kernel tests with their slow CUDA cases (TRITON_TESTS_TIMEOUT seconds, default
#    600). OUT_DIR/tests-triton.log.
# 4. benchmarks/kernels.py: CASTLE, GCA and the window op against causal SDPA at training shapes
#    (KERNELS_TIMEOUT seconds, default 600; KERNELS_ARGS adds arguments, e.g. "--peer PATH").
#    OUT_DIR/kernels.log and kernels.json.
# 5. benchmarks/drt.py's training step on the GPU in bf16-mixed, DRT against BaseLM at 4K and 16K
#    with 64K tokens per step. OUT_DIR/drt-train.log and drt-train.json.
# The exit status is 1 when any part failed.
set -uo pipefail
out=${1:-gpu-check}
work=$(mktemp -d) # the corpus and the training runs
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
$python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

quick_tests() {
    $python -m pytest -q -p no:cacheprovider -rf tests/models/test_cuda.py tests/ops/test_autocast.py 2>&1 | tee "$out/tests-cuda.log"
}

train_runs() {
    local data=$work/stdlib-byte kind config shape batch seq layout
    $python -m farsight.cli data prepare --source stdlib --tokenizer byte --out "$data" >/dev/null 2>&1 || return 1
    local width=(--set model.d_model=512 --set model.n_layers=8 --set model.n_heads=8 --set model.head_dim=64)
    local run=(--set data.path="$data" --set train.steps="${TRAIN_STEPS:-40}" --set train.device="${TRAIN_DEVICE:-cuda}"
        --set train.precision=bf16-mixed --set train.log_interval=5 --set train.eval_interval=1000
        --set train.checkpoint_interval=1000 --no-progress --restart)
    for shape in ${TRAIN_SHAPES:-8x2048 2x8192}; do
        batch=${shape%x*} seq=${shape#*x}
        for kind in ${TRAIN_KINDS:-causal castle castle-passes baselm drt-x2}; do
            layout=fused # castle-passes: the CASTLE backward in two passes (farsight.ops.castle.triton.BACKWARD)
            case $kind in
                causal | castle) config=configs/castle/$kind.yaml ;;
                castle-passes) config=configs/castle/castle.yaml layout=passes ;;
                *) config=configs/lm/pretrain/$kind.yaml ;;
            esac
            if ! FARSIGHT_CASTLE_BACKWARD=$layout $python -m farsight.cli train "$config" "${width[@]}" "${run[@]}" \
                --set data.batch_size="$batch" --set data.seq_len="$seq" --set train.out_dir="$work/run-$kind-$shape" \
                >"$out/train-$kind-$shape.log" 2>&1; then
                tail -5 "$out/train-$kind-$shape.log"
                return 1
            fi
        done
    done
    $python - "$work" <<'EOF' | tee "$out/train-summary.txt"
import json, pathlib, statistics, sys
speed = {}
for run in sorted(pathlib.Path(sys.argv[1]).glob("run-*")):
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 10]
    kind, shape = run.name[len("run-"):].rsplit("-", 1)
    if not steps:
        print(f"{kind:14s} {shape:8s} no step logged after step 10 (raise TRAIN_STEPS)")
        continue
    speed[kind, shape] = statistics.median(steps)
    print(f"{kind:14s} {shape:8s} {speed[kind, shape]:12.0f} tokens/s (median of {len(steps)} logged steps after step 10)")
for (kind, shape), rate in speed.items():
    if kind != "causal" and ("causal", shape) in speed:
        print(f"{shape}: causal / {kind}: {speed['causal', shape] / rate:.2f}x")
EOF
}

triton_tests() {
    timeout "${TRITON_TESTS_TIMEOUT:-600}" $python -m pytest -q -p no:cacheprovider -rf -m "slow or not slow" \
        tests/ops/test_gca_triton.py tests/ops/test_castle_triton.py 2>&1 | tee "$out/tests-triton.log"
}

kernel_benchmark() {
    # shellcheck disable=SC2086 # KERNELS_ARGS is a list of arguments
    timeout "${KERNELS_TIMEOUT:-600}" $python benchmarks/kernels.py --json "$out/kernels.json" ${KERNELS_ARGS:-} 2>&1 |
        tee "$out/kernels.log"
}

drt_train_benchmark() {
    $python benchmarks/drt.py --parts train --train-device cuda --train-precisions bf16-mixed --train-tokens 65536 \
        --train-lengths 4k,16k --json "$out/drt-train.json" 2>&1 | tee "$out/drt-train.log"
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # the benchmarks import farsight from this checkout
status=0
for part in ${PARTS:-1 2 3 4 5}; do
    case $part in
        1) quick_tests || status=1 ;;
        2) train_runs || status=1 ;;
        3) triton_tests || status=1 ;;
        4) kernel_benchmark || status=1 ;;
        5) drt_train_benchmark || status=1 ;;
        *) echo "unknown part $part (1 to 5)" >&2 && exit 2 ;;
    esac
done
exit $status
