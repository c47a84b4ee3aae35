#!/usr/bin/env bash
# R4 (language-model protocol): retriever ablations on R3's recipe, each configs/lm/pretrain/drt-x1.yaml
# with one switch flipped (configs/lm/ablations/): no Gumbel noise, random retrieval, plain softmax
# instead of softmax off by one. Scored against R3's drt-x1 on the same held-out windows
# (4K -> 128K) and, after the same passkey fine-tune as R1, on passkey extrapolation (1K -> 1M).
# Needs R3's and R1's drt-x1: `make r1`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r4
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
$F train configs/lm/pretrain/drt-x1.yaml --no-progress
$F train configs/lm/passkey/drt-x1.yaml --no-progress
MODELS=(--model runs/lm/pretrain/drt-x1)
RESULTS=("results/r1/lm-drt-x1.json")
LABELS="drt-x1"
for model in drt-x1-no-gumbel drt-x1-random drt-x1-plain-softmax; do
    $F train "configs/lm/ablations/$model.yaml" --no-progress
    $F train "configs/lm/ablations/$model-passkey.yaml" --no-progress
    MODELS+=(--model "runs/lm/ablations/$model")
    $F eval passkey --model "runs/lm/ablations/$model-passkey" --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.25,0.5,0.75,1 \
        --trials 10 --long-trials 4 --corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/lm-passkey-$model.json"
    RESULTS+=("$OUT/lm-passkey-$model.json")
    LABELS+=",$model"
done
$F eval ppl "${MODELS[@]}" --corpus data/lm-byte --split val --lengths 4k,8k,16k,32k,64k,128k --windows 12 \
    --window-length 128k --batch-size 1 --dtype bf16 --out "$OUT/lm-ppl.json" --plot "$FIG/r4-lm-ablations.png"
# A second seed (train.seed=1: another initialisation and data order) of drt-x1 and of plain
# softmax, the ablation that came out ahead on the first seed, on the same windows. A seed's run is
# its config's out_dir with -s1.
for config in lm/pretrain/drt-x1 lm/ablations/drt-x1-plain-softmax; do
    $F train "configs/$config.yaml" --no-progress --set train.seed=1 --set "train.out_dir=runs/$config-s1"
done
PPL=(--corpus data/lm-byte --split val --lengths 4k,8k,16k,32k,64k,128k --windows 12 --window-length 128k --batch-size 1 --dtype bf16)
$F eval ppl --model runs/lm/pretrain/drt-x1 --model runs/lm/pretrain/drt-x1-s1 "${PPL[@]}" --out "$OUT/lm-ppl-drt-x1-seeds.json"
$F eval ppl --model runs/lm/pretrain/drt-x1-s1 --model runs/lm/ablations/drt-x1-plain-softmax-s1 "${PPL[@]}" --out "$OUT/lm-ppl-s1.json"
# both second seeds through the same passkey fine-tune (seed 1 there too), on the same grid:
# model, its pre-trained second seed, its passkey fine-tune's config
for model in drt-x1 drt-x1-plain-softmax; do
    case $model in
        drt-x1) pretrained=runs/lm/pretrain/drt-x1-s1 config=lm/passkey/drt-x1 ;;
        *) pretrained=runs/lm/ablations/$model-s1 config=lm/ablations/$model-passkey ;;
    esac
    $F train "configs/$config.yaml" --no-progress --set train.seed=1 --set "train.init_from=$pretrained" \
        --set "train.out_dir=runs/$config-s1"
    $F eval passkey --model "runs/$config-s1" --lengths 1k,4k,16k,64k,256k,1m --depths 0,0.25,0.5,0.75,1 \
        --trials 10 --long-trials 4 --corpus data/lm-byte --split val --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/lm-passkey-$model-s1.json"
done
$F eval compare "${RESULTS[@]}" --labels "$LABELS" --plot "$FIG/r4-lm-passkey.png" \
    --title "R4: passkey exact match vs length, retriever ablations" | tee "$OUT/lm-passkey.txt"
