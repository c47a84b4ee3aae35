#!/usr/bin/env bash
# R2 (issue 18): multi-key and 2-hop NIAH (with distractor chains) vs context length, DRT x2 vs
# DRT x1 vs the baselines, each fine-tuned from its R1 passkey model (`make r1`) on the task mix of
# configs/lm-*-niah.yaml (passkey 2 : multi-key 1 : 2-hop 1, lengths 256 -> 1K, answer weight 1000,
# 5.2M tokens). Run from the repository root: `make r2`. Not yet run end to end: docs/results.md
# reports DRT x1's stage 2 on 12 samples per length, where neither task is learnt.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r2
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
# the multi-key trial of docs/results.md: DRT x2 on two keys per sample (600 steps, and the same
# recipe over 1500), then on four keys; DRT x1 the same from 1500 steps on; each scored with 2 and 4
# keys and on the passkey it started from
SMALL=(--corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 4)
for run in drt-g2-multikey2 drt-g2-multikey2-1500 drt-g2-multikey4 drt-multikey2-1500 drt-multikey4; do
    $F train "configs/lm-$run.yaml" --no-progress
    mkdir -p "$OUT/lm-$run"
    for keys in 2 4; do
        $F eval multikey --model "runs/lm-$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=$keys "${SMALL[@]}" \
            --out "$OUT/lm-$run/multikey$keys.json"
    done
    $F eval passkey --model "runs/lm-$run" --lengths 1k,16k --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/lm-$run/passkey.json"
done
# the four-key model from 1K to 1M (24 samples per length to 64K, 6 beyond)
$F eval multikey --model runs/lm-drt-g2-multikey4 --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.5,1 --trials 8 --long-trials 2 \
    --task-option keys=4 "${SMALL[@]}" --out "$OUT/lm-drt-g2-multikey4/multikey4-1m.json" --plot "$FIG/r2-lm-multikey4-drt-g2.png"
# 2-hop after the multi-key curriculum: no distractor chains, then one; DRT x2, then DRT x1
for run in drt-g2-niah2hop drt-g2-niah2hop-d1 drt-niah2hop drt-niah2hop-d1; do
    $F train "configs/lm-$run.yaml" --no-progress
    mkdir -p "$OUT/lm-$run"
    for distractors in 0 1 2; do
        $F eval niah2hop --model "runs/lm-$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option distractors=$distractors \
            "${SMALL[@]}" --out "$OUT/lm-$run/niah2hop-distractors$distractors.json"
    done
    $F eval multikey --model "runs/lm-$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=4 "${SMALL[@]}" \
        --out "$OUT/lm-$run/multikey4.json"
    $F eval passkey --model "runs/lm-$run" --lengths 1k,16k --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/lm-$run/passkey.json"
done
# the full R2 grid (not yet run end to end)
MODELS=(drt-g2 drt baselm baselm-2l causal)
LABELS="DRT x2,DRT x1,BaseLM,BaseLM+2L,full attention"
for model in "${MODELS[@]}"; do
    $F train "configs/lm-$model-niah.yaml" --no-progress
done
COMMON=(--corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2 --depths 0,0.25,0.5,0.75,1 --trials 10 --long-trials 4)
for task in multikey niah2hop; do
    OPTIONS=()
    [ "$task" = niah2hop ] && OPTIONS=(--task-option distractors=2)
    for model in drt-g2 drt; do
        $F eval "$task" --model "runs/lm-$model-niah" --lengths 1k,4k,16k,64k,256k,1m "${COMMON[@]}" "${OPTIONS[@]}" \
            --out "$OUT/lm-$task-$model.json" --plot "$FIG/r2-lm-$task-$model.png"
    done
    for model in baselm baselm-2l; do
        $F eval "$task" --model "runs/lm-$model-niah" --lengths 1k,4k,16k,64k "${COMMON[@]}" "${OPTIONS[@]}" --out "$OUT/lm-$task-$model.json"
    done
    $F eval "$task" --model runs/lm-causal-niah --lengths 1k,4k,16k "${COMMON[@]}" "${OPTIONS[@]}" --out "$OUT/lm-$task-causal.json"
    $F eval compare "$OUT/lm-$task"-{drt-g2,drt,baselm,baselm-2l,causal}.json --labels "$LABELS" \
        --plot "$FIG/r2-lm-$task.png" --title "R2: $task exact match vs length" | tee "$OUT/lm-$task.txt"
done
