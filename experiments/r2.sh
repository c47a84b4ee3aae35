#!/usr/bin/env bash
# R2 (language-model protocol): multi-key and 2-hop NIAH (with distractor chains) vs context length,
# drt-x2 vs drt-x1 vs causal vs baselm vs baselm-2l, each fine-tuned from its R1 passkey model
# (`make r1`) on one curriculum (configs/lm/curriculum/<model>/, stages numbered in order):
# multi-key with two keys, then four, then 2-hop with 0, 1 and 2 distractor chains (1000-1500 steps
# of 8192 tokens each, lengths 256 -> 1K, answer weight 1000, baselm and baselm-2l 10); causal goes
# on with two more stages at 4K. Each run is runs/lm/curriculum/<model>/<stage> and its results
# results/r2/<model>/<stage>/. Run from the repository root: `make r2`; a finished run is reused.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r2
FIG=docs/figures
CUR=lm/curriculum
mkdir -p "$OUT" "$FIG"
# the multi-key stages of docs/results.md: drt-x2 on two keys per sample (600 steps, and the same
# recipe over 1500), then on four keys; drt-x1 the same from 1500 steps on; each scored with 2 and 4
# keys and on the passkey it started from
SMALL=(--corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 4)
for run in drt-x2/1-multikey2-600steps drt-x2/1-multikey2 drt-x2/2-multikey4 drt-x1/1-multikey2 drt-x1/2-multikey4; do
    $F train "configs/$CUR/$run.yaml" --no-progress
    mkdir -p "$OUT/$run"
    for keys in 2 4; do
        $F eval multikey --model "runs/$CUR/$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=$keys "${SMALL[@]}" \
            --out "$OUT/$run/multikey$keys.json"
    done
    $F eval passkey --model "runs/$CUR/$run" --lengths 1k,16k --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/$run/passkey.json"
done
# the four-key model from 1K to 1M (24 samples per length to 64K, 6 beyond)
$F eval multikey --model runs/$CUR/drt-x2/2-multikey4 --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.5,1 --trials 8 --long-trials 2 \
    --task-option keys=4 "${SMALL[@]}" --out "$OUT/drt-x2/2-multikey4/multikey4-1m.json" --plot "$FIG/r2-lm-multikey4-drt-x2.png"
# 2-hop after the multi-key curriculum: no distractor chains, then one, then two; drt-x2, then drt-x1
for model in drt-x2 drt-x1; do
    for stage in 3-niah2hop-d0 4-niah2hop-d1 5-niah2hop-d2; do
        run=$model/$stage
        $F train "configs/$CUR/$run.yaml" --no-progress
        mkdir -p "$OUT/$run"
        for distractors in 0 1 2; do
            $F eval niah2hop --model "runs/$CUR/$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option distractors=$distractors \
                "${SMALL[@]}" --out "$OUT/$run/niah2hop-distractors$distractors.json"
        done
        $F eval multikey --model "runs/$CUR/$run" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=4 "${SMALL[@]}" \
            --out "$OUT/$run/multikey4.json"
        $F eval passkey --model "runs/$CUR/$run" --lengths 1k,16k --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/$run/passkey.json"
    done
done
# the baselines on the same curriculum from their passkey models: causal (every needle of 1K and 4K
# in its span), then two more stages with haystacks to 4K; baselm (window 64) and baselm-2l
step_evals() {  # run (<model>/<stage>), passkey lengths
    mkdir -p "$OUT/$1"
    for distractors in 0 1 2; do
        $F eval niah2hop --model "runs/$CUR/$1" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option distractors=$distractors \
            "${SMALL[@]}" --out "$OUT/$1/niah2hop-distractors$distractors.json"
    done
    for keys in 2 4; do
        $F eval multikey --model "runs/$CUR/$1" --lengths 1k,4k --depths 0,0.5,1 --trials 8 --task-option keys=$keys "${SMALL[@]}" \
            --out "$OUT/$1/multikey$keys.json"
    done
    $F eval passkey --model "runs/$CUR/$1" --lengths "$2" --depths 0,0.5,1 --trials 4 "${SMALL[@]}" --out "$OUT/$1/passkey.json"
}
STAGES=(1-multikey2 2-multikey4 3-niah2hop-d0 4-niah2hop-d1 5-niah2hop-d2)
for stage in "${STAGES[@]}" 6-niah2hop-d2-4k 7-niah2hop-d2-4k-only; do
    $F train "configs/$CUR/causal/$stage.yaml" --no-progress
    step_evals "causal/$stage" 1k,4k
done
for model in baselm baselm-2l; do
    for stage in "${STAGES[@]}"; do
        $F train "configs/$CUR/$model/$stage.yaml" --no-progress
        step_evals "$model/$stage" 1k,16k
    done
done
# the baselines' in-span check after the curriculum, as R1's (the needle at depth 1 for baselm,
# anywhere in 4K for causal)
COMMON=(--corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2)
for run in baselm/5-niah2hop-d2 baselm-2l/5-niah2hop-d2; do
    $F eval passkey --model "runs/$CUR/$run" --lengths 1k,4k --depths 1 --trials 50 "${COMMON[@]}" --out "$OUT/$run/inspan.json"
done
for run in causal/5-niah2hop-d2 causal/7-niah2hop-d2-4k-only; do
    $F eval passkey --model "runs/$CUR/$run" --lengths 1k,4k --depths 0,0.25,0.5,0.75,1 --trials 10 "${COMMON[@]}" --out "$OUT/$run/inspan.json"
done
# the baselines after the curriculum on one task past their span: task, its --task-option, the
# results' name; the sliding windows to 64K, causal to 16K (its cost grows as L^2)
baselines_grid() {
    local grid=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option "$2" "${SMALL[@]}")
    for run in baselm/5-niah2hop-d2 baselm-2l/5-niah2hop-d2; do
        $F eval "$1" --model "runs/$CUR/$run" --lengths 1k,4k,16k,64k "${grid[@]}" --out "$OUT/$run/$3-64k.json"
    done
    for run in causal/5-niah2hop-d2 causal/7-niah2hop-d2-4k-only; do
        $F eval "$1" --model "runs/$CUR/$run" --lengths 1k,4k,16k "${grid[@]}" --batch-size 1 --out "$OUT/$run/$3-16k.json"
    done
}
# the last stage's models on the paper's setting (two distractor chains) past the fine-tune length,
# 96 samples per length to 64K (a 95% interval of at most +-10 points), 24 beyond
LONG=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option distractors=2 "${SMALL[@]}")
for model in drt-x2 drt-x1; do
    $F eval niah2hop --model "runs/$CUR/$model/5-niah2hop-d2" --lengths 1k,4k,16k,64k,256k,1m "${LONG[@]}" \
        --out "$OUT/$model/5-niah2hop-d2/niah2hop-distractors2-1m.json" --plot "$FIG/r2-lm-niah2hop-$model.png"
done
baselines_grid niah2hop distractors=2 niah2hop-distractors2
$F eval compare "$OUT"/{drt-x2,drt-x1}/5-niah2hop-d2/niah2hop-distractors2-1m.json \
    "$OUT"/causal/{5-niah2hop-d2,7-niah2hop-d2-4k-only}/niah2hop-distractors2-16k.json \
    "$OUT"/{baselm,baselm-2l}/5-niah2hop-d2/niah2hop-distractors2-64k.json \
    --labels "drt-x2,drt-x1,causal (to 1K),causal (then 4K),baselm,baselm-2l" \
    --plot "$FIG/r2-lm-niah2hop.png" --title "R2: 2-hop NIAH, two distractor chains, after the curriculum" | tee "$OUT/lm-niah2hop.txt"
# four-key multi-key with the same models and grid; the DRTs' 256K-1M in a second call, which
# gives the same samples (each depends only on its seed, length, depth and trial)
MK=(--depths 0,0.5,1 --trials 32 --long-trials 8 --task-option keys=4 "${SMALL[@]}")
for model in drt-x2 drt-x1; do
    $F eval multikey --model "runs/$CUR/$model/5-niah2hop-d2" --lengths 1k,4k,16k,64k "${MK[@]}" --out "$OUT/$model/5-niah2hop-d2/multikey4-64k.json"
    $F eval multikey --model "runs/$CUR/$model/5-niah2hop-d2" --lengths 256k,1m "${MK[@]}" --out "$OUT/$model/5-niah2hop-d2/multikey4-256k-1m.json"
done
baselines_grid multikey keys=4 multikey4
$F eval compare "$OUT"/drt-x2/5-niah2hop-d2/multikey4-{64k,256k-1m}.json "$OUT"/drt-x1/5-niah2hop-d2/multikey4-{64k,256k-1m}.json \
    "$OUT"/causal/{5-niah2hop-d2,7-niah2hop-d2-4k-only}/multikey4-16k.json "$OUT"/{baselm,baselm-2l}/5-niah2hop-d2/multikey4-64k.json \
    --labels "drt-x2,drt-x2,drt-x1,drt-x1,causal (to 1K),causal (then 4K),baselm,baselm-2l" \
    --plot "$FIG/r2-lm-multikey4.png" --title "R2: multi-key NIAH, 4 keys, after the curriculum" | tee "$OUT/lm-multikey4.txt"
