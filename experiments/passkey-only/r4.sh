#!/usr/bin/env bash
# The first protocol of docs/results.md (stops up to 23; models trained only on passkey samples or
# for 150 steps), kept so that its figures stay reproducible; issue 18's protocol is experiments/r4.sh.
# R4 ablations of the retriever (SPEC 2.3) on R3's language-modelling task: no Gumbel noise, random
# retrieval, plain softmax instead of softmax off by one; each is R3's DRT recipe with one switch
# flipped, scored against R3's DRT on the same held-out windows from 1K to 32K (docs/results.md).
# Needs its R3 DRT: `bash experiments/passkey-only/r3.sh`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r4
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
MODELS=(--model runs/r3-drt)
for ablation in nogumbel random nosoftmax1; do
    $F train "configs/r4-drt-$ablation.yaml" --no-progress
    MODELS+=(--model "runs/r4-drt-$ablation")
done
$F eval ppl "${MODELS[@]}" --corpus data/stdlib-byte --split val \
    --lengths 1k,2k,4k,8k,16k,32k --windows 8 --batch-size 1 --out "$OUT/ppl.json" --plot "$FIG/r4-ablations.png"
