#!/usr/bin/env bash
# R2 (issue 18): multi-key and 2-hop NIAH (with distractor chains) vs context length, DRT x2 vs
# DRT x1 vs full attention vs BaseLM vs BaseLM+2L, each fine-tuned from its R1 passkey model (`make r1`) on one
# curriculum: multi-key with two keys, then four, then 2-hop with 0, 1 and 2 distractor chains
# (1000-1500 steps of 8192 tokens each, lengths 256 -> 1K, answer weight 1000, BaseLM and BaseLM+2L 10;
# configs/lm-<model>-multikey2-1500.yaml ... lm-<model>-niah2hop-d2.yaml); full attention goes on
# with two more steps at 4K. Run from the repository root: `make r2`; a finished run is reused.
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
# 2-hop after the multi-key curriculum: no distractor chains, then one, then two; DRT x2, then DRT x1
for run in drt-g2-niah2hop drt-g2-niah2hop-d1 drt-g2-niah2hop-d2 drt-niah2hop drt-niah2hop-d1 drt-niah2hop-d2; do
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
# the baselines on the same curriculum from their passkey models: full attention (every needle of 1K
# and 4K in its span), then two more steps with haystacks to 4K; BaseLM (window 64) and BaseLM+2L
step_evals() {  # run, passkey lengths
    mkdir -p "$OUT/lm-$1"
    for distractors in 0 1 2; do
        $F eval niah2hop --model "runs/lm-$1" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option distractors=$distractors \
            "${SMALL[@]}" --out "$OUT/lm-$1/niah2hop-distractors$distractors.json"
    done
    for keys in 2 4; do
        $F eval multikey --model "runs/lm-$1" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=$keys "${SMALL[@]}" \
            --out "$OUT/lm-$1/multikey$keys.json"
    done
    $F eval passkey --model "runs/lm-$1" --lengths "$2" --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/lm-$1/passkey.json"
}
for run in causal-multikey2-1500 causal-multikey4 causal-niah2hop causal-niah2hop-d1 causal-niah2hop-d2 causal-niah2hop-d2-4k causal-niah2hop-d2-4k2; do
    $F train "configs/lm-$run.yaml" --no-progress
    step_evals $run 1k,4k
done
for model in baselm baselm-2l; do
    for step in multikey2-1500 multikey4 niah2hop niah2hop-d1 niah2hop-d2; do
        $F train "configs/lm-$model-$step.yaml" --no-progress
        step_evals "$model-$step" 1k,16k
    done
done
# the baselines' in-span check after the curriculum, as R1's (the needle at depth 1 for BaseLM,
# anywhere in 4K for full attention)
COMMON=(--corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2)
for run in baselm-niah2hop-d2 baselm-2l-niah2hop-d2; do
    $F eval passkey --model "runs/lm-$run" --lengths 1k,4k --depths 1 --trials 50 "${COMMON[@]}" --out "$OUT/lm-$run/inspan.json"
done
for run in causal-niah2hop-d2 causal-niah2hop-d2-4k2; do
    $F eval passkey --model "runs/lm-$run" --lengths 1k,4k --depths 0,0.25,0.5,0.75,1 --trials 10 "${COMMON[@]}" --out "$OUT/lm-$run/inspan.json"
done
# the baselines after the curriculum on one task past their span: task, its --task-option, the
# results' name; the sliding windows to 64K, full attention to 16K (its cost grows as L^2)
baselines_grid() {
    local grid=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option "$2" "${SMALL[@]}")
    for run in baselm-niah2hop-d2 baselm-2l-niah2hop-d2; do
        $F eval "$1" --model "runs/lm-$run" --lengths 1k,4k,16k,64k "${grid[@]}" --out "$OUT/lm-$run/$3-64k.json"
    done
    for run in causal-niah2hop-d2 causal-niah2hop-d2-4k2; do
        $F eval "$1" --model "runs/lm-$run" --lengths 1k,4k,16k "${grid[@]}" --batch-size 1 --out "$OUT/lm-$run/$3-16k.json"
    done
}
# the last step's models on the paper's setting (two distractor chains) past the fine-tune length,
# 96 samples per length to 64K (a 95% interval of at most +-10 points), 24 beyond
LONG=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option distractors=2 "${SMALL[@]}")
for model in drt-g2 drt; do
    $F eval niah2hop --model "runs/lm-$model-niah2hop-d2" --lengths 1k,4k,16k,64k,256k,1m "${LONG[@]}" \
        --out "$OUT/lm-$model-niah2hop-d2/niah2hop-distractors2-1m.json" --plot "$FIG/r2-lm-niah2hop-$model.png"
done
baselines_grid niah2hop distractors=2 niah2hop-distractors2
$F eval compare "$OUT"/lm-drt-{g2-,}niah2hop-d2/niah2hop-distractors2-1m.json "$OUT"/lm-causal-niah2hop-d2{,-4k2}/niah2hop-distractors2-16k.json \
    "$OUT"/lm-baselm{,-2l}-niah2hop-d2/niah2hop-distractors2-64k.json \
    --labels "DRT x2,DRT x1,full attention (to 1K),full attention (then 4K),BaseLM,BaseLM+2L" \
    --plot "$FIG/r2-lm-niah2hop.png" --title "R2: 2-hop NIAH, two distractor chains, after the curriculum" | tee "$OUT/lm-niah2hop.txt"
# four-key multi-key with the same models and grid; the DRTs' 256K-1M in a second call, which
# gives the same samples (each depends only on its seed, length, depth and trial)
MK=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option keys=4 "${SMALL[@]}")
for model in drt-g2 drt; do
    $F eval multikey --model "runs/lm-$model-niah2hop-d2" --lengths 1k,4k,16k,64k "${MK[@]}" --out "$OUT/lm-$model-niah2hop-d2/multikey4-64k.json"
    $F eval multikey --model "runs/lm-$model-niah2hop-d2" --lengths 256k,1m "${MK[@]}" --out "$OUT/lm-$model-niah2hop-d2/multikey4-256k-1m.json"
done
baselines_grid multikey keys=4 multikey4
$F eval compare "$OUT"/lm-drt-g2-niah2hop-d2/multikey4-{64k,256k-1m}.json "$OUT"/lm-drt-niah2hop-d2/multikey4-{64k,256k-1m}.json \
    "$OUT"/lm-causal-niah2hop-d2{,-4k2}/multikey4-16k.json "$OUT"/lm-baselm{,-2l}-niah2hop-d2/multikey4-64k.json \
    --labels "DRT x2,DRT x2,DRT x1,DRT x1,full attention (to 1K),full attention (then 4K),BaseLM,BaseLM+2L" \
    --plot "$FIG/r2-lm-multikey4.png" --title "R2: multi-key NIAH, 4 keys, after the curriculum" | tee "$OUT/lm-multikey4.txt"
