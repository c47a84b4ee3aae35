#!/usr/bin/env bash
# Pre-training the BPE models of configs/bpe/pretrain/ (drt-x2, baselm-2l, then drt-x1) on a GPU
# machine lent for minutes: one call of at most 9 minutes, which gets the repository (tracked files)
# plus a few carried folders (64 MiB in all, no network) and returns at most 8 files of up to 16 MiB
# (64 MiB together). Helper: experiments/gpu_pretrain.py. Run from the repository root.
#
#   bash experiments/gpu-pretrain.sh corpus              # here (CPU): the corpus archive to carry
#   bash experiments/gpu-pretrain.sh train [OUT_DIR]     # there (GPU): train, pack into $OUT
#   bash experiments/gpu-pretrain.sh reassemble DIR [RUNS]  # here: DIR's packed files -> RUNS/MODEL
#   DRY_RUN=1 bash experiments/gpu-pretrain.sh train DIR    # the same on this CPU, a tiny model
#
# corpus: builds the BPE corpus (experiments/code-corpus.sh: data/code-bpe16k-tokens, 65.0M
#   training tokens) and packs its token files into data/gpu-pretrain/corpus.tar.xz (xz -9e of a
#   tar with fixed metadata: the same tokens give the same bytes) and corpus.tar.xz.json (its
#   SHA-256, each file's SHA-256, the token counts). Carry the folder data/gpu-pretrain.
# train: unpacks the archive into data/code-bpe16k-tokens, checking the archive's SHA-256
#   (corpus.tar.xz.json, and CORPUS_SHA256 when set) and every file's; then `farsight train` of
#   each model with bf16-mixed, compiled (train.compile=true), the default kernels and the same
#   data order (same seed, length and batch), into runs/gpu-pretrain/MODEL:
#   1. probe: the first PROBE_STEPS steps of each of MODELS (inside the warmup, whose learning rate
#      does not depend on the run's length, so they are the run's own steps): tokens/s and start-up
#      time (compilation included); a probe that fails (a compiled model whose gradient vanished
#      stops with an error) is tried again uncompiled, then also with FARSIGHT_TRITON=0, and the
#      run keeps the setting that worked;
#   2. plan (runs/gpu-pretrain/plan.json): the steps every model trains, TOKENS or, with ADAPT=1,
#      as many as let all MODELS finish before BUDGET_S, the same for each;
#   3. each of MODELS resumes its probe to that many steps, with a checkpoint every CKPT_S seconds
#      at the measured speed; then each of EXTRA, with the same steps, if it can finish in time;
#      each run gets a SIGINT at its time limit (MODEL_LIMIT_S, else 1.3x its predicted time plus
#      a minute, never past BUDGET_S - RESERVE_S): the trainer saves a checkpoint and stops (a
#      SIGKILL RESERVE_S - 15 seconds later if it has not);
#   4. pack, after each model and at the end, into OUT_DIR: log.txt (written as it goes),
#      pack.json (what each file holds, with SHA-256), runs.tar.xz (plan, configs, metrics, the
#      newest checkpoint's small files) and payload.part00.. (at most 15 MiB each): a finished
#      model's weights in bf16 (18.4 MB for drt-x2), a cut-off model's bf16 weights and AdamW
#      moments in 8-bit floats (45 MB; its full fp32 checkpoint, 157 MB, would not come back);
#      finished models first, what does not fit is named in the log.
#   Run again on the same machine, it resumes the plan and the runs where they stopped.
# reassemble: checks every part and tensor against pack.json and writes RUNS/MODEL (default
#   runs/gpu-pretrain/MODEL): a run directory whose newest checkpoint holds the weights as fp32
#   (rounded to bf16 once), loadable as a model (`--set train.init_from=runs/gpu-pretrain/drt-x2`);
#   a cut-off run's checkpoint also holds the trainer state, so the same `train` resumes it (here
#   on the CPU with DEVICE=cpu; on another GPU machine its 45 MB would not fit the carry beside
#   the corpus and the tree, so plan whole runs per call, as ADAPT=1 does).
#
# Settings (environment): MODELS ("drt-x2 baselm-2l"), EXTRA ("drt-x1"), TOKENS per model
# (100000000), ADAPT (1: fewer tokens when the measured speed says they would not finish),
# SEQ (4096), BATCH (16, so 65,536 tokens a step), BUDGET_S (540: seconds for the whole call,
# from the script's start), RESERVE_S (45: kept for packing), MODEL_LIMIT_S (a cap per model run),
# CKPT_S (120), RATE (500000: the tokens/s assumed with ADAPT=0, for the checkpoint interval and
# the time limit), PROBE_STEPS (40), WARMUP_TOKENS (3276800: the configs' 200 steps of 16K tokens),
# PRECISION (bf16-mixed), COMPILE (true), DEVICE (cuda), EVAL_BATCHES (8), RUNS
# (runs/gpu-pretrain), CORPUS (data/gpu-pretrain/corpus.tar.xz), CORPUS_SHA256, SET (more
# `--set` overrides, space-separated), SET_<MODEL> (overrides for one model, e.g. SET_DRT_X2), PYTHON (.venv/bin/python if there, else python3).
# DRY_RUN=1: the same steps on the CPU at a tiny scale: a d_model-64 four-layer model of each kind,
# 1024-token windows, 2 a step, 300K tokens, fp32, not compiled, RUNS=runs/gpu-pretrain-dry.
#
# The archive (31 MB) and the working tree travel together within 64 MiB: models/bpe-drt-x2
# (26 MB) leaves too little room, so move it out of the working tree for the GPU call.
# On the GPU machine (with `carry: ["data/gpu-pretrain"]`, timeout_s 600):
#   bash experiments/gpu-pretrain.sh train "$OUT"
# then here: bash experiments/gpu-pretrain.sh reassemble DIR_OF_THE_RETURNED_FILES
set -euo pipefail
command=${1:-train}
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python
case $command in
corpus)
    start=$(date +%s)
    bash experiments/code-corpus.sh
    echo "corpus built in $(($(date +%s) - start)) s"
    start=$(date +%s)
    nice -n 10 $py experiments/gpu_pretrain.py pack-corpus data/code-bpe16k-tokens data/gpu-pretrain/corpus.tar.xz
    echo "corpus packed in $(($(date +%s) - start)) s"
    ;;
train)
    out=${1:-${OUT:-out/gpu-pretrain}}
    mkdir -p "$out"
    {
        echo "gpu-pretrain: $(date -u '+%F %T') UTC on $(hostname)"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
        $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
        $py experiments/gpu_pretrain.py train "$out"
    } 2>&1 | tee -a "$out/log.txt"
    ;;
reassemble)
    [ $# -ge 1 ] || { echo "usage: $0 reassemble DIR [RUNS]" >&2; exit 2; }
    $py experiments/gpu_pretrain.py reassemble "$1" "${2:-runs/gpu-pretrain}"
    ;;
*)
    echo "usage: $0 corpus | train [OUT_DIR] | reassemble DIR [RUNS]" >&2
    exit 2
    ;;
esac
