#!/usr/bin/env bash
# R4 (issue 18): retriever ablations on R3's recipe, each configs/lm-drt.yaml with one switch
# flipped (SPEC 2.3): no Gumbel noise, random retrieval, plain softmax instead of softmax off by
# one. Scored against R3's DRT on the same held-out windows (4K -> 128K) and, after the same
# passkey fine-tune as R1, on passkey extrapolation (1K -> 1M). Needs R3's and R1's DRT: `make r1`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r4
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
$F train configs/lm-drt.yaml --no-progress
$F train configs/lm-drt-passkey.yaml --no-progress
MODELS=(--model runs/lm-drt)
RESULTS=("results/r1/lm-drt.json")
LABELS="DRT"
for ablation in nogumbel random nosoftmax1; do
    $F train "configs/lm-drt-$ablation.yaml" --no-progress
    $F train "configs/lm-drt-$ablation-passkey.yaml" --no-progress
    MODELS+=(--model "runs/lm-drt-$ablation")
    $F eval passkey --model "runs/lm-drt-$ablation-passkey" --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.25,0.5,0.75,1 \
        --trials 10 --long-trials 4 --corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/lm-passkey-$ablation.json"
    RESULTS+=("$OUT/lm-passkey-$ablation.json")
    LABELS+=",$ablation"
done
$F eval ppl "${MODELS[@]}" --corpus data/lm-byte --split val --lengths 4k,8k,16k,32k,64k,128k --windows 12 \
    --window-length 128k --batch-size 1 --dtype bf16 --out "$OUT/lm-ppl.json" --plot "$FIG/r4-lm-ablations.png"
# A second seed (train.seed=1: another initialisation and data order) of DRT x1 and of plain
# softmax, the ablation that came out ahead on the first seed, on the same windows.
for run in drt drt-nosoftmax1; do
    $F train "configs/lm-$run.yaml" --no-progress --set train.seed=1 --set "train.out_dir=runs/lm-$run-s1"
done
PPL=(--corpus data/lm-byte --split val --lengths 4k,8k,16k,32k,64k,128k --windows 12 --window-length 128k --batch-size 1 --dtype bf16)
$F eval ppl --model runs/lm-drt --model runs/lm-drt-s1 "${PPL[@]}" --out "$OUT/lm-ppl-drt-seeds.json"
$F eval ppl --model runs/lm-drt-s1 --model runs/lm-drt-nosoftmax1-s1 "${PPL[@]}" --out "$OUT/lm-ppl-s1.json"
# both second seeds through the same passkey stage 1 (seed 1 there too), on the same grid
for run in drt drt-nosoftmax1; do
    $F train "configs/lm-$run-passkey.yaml" --no-progress --set train.seed=1 --set "train.init_from=runs/lm-$run-s1" \
        --set "train.out_dir=runs/lm-$run-s1-passkey"
    $F eval passkey --model "runs/lm-$run-s1-passkey" --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.25,0.5,0.75,1 \
        --trials 10 --long-trials 4 --corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/lm-passkey-$run-s1.json"
done
$F eval compare "${RESULTS[@]}" --labels "$LABELS" --plot "$FIG/r4-lm-passkey.png" \
    --title "R4: passkey exact match vs length, retriever ablations" | tee "$OUT/lm-passkey.txt"
