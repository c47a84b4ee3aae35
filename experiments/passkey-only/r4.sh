#!/usr/bin/env bash
# The first protocol of docs/results.md (models trained only on passkey samples or for 150 steps;
# configs/passkey-only/), kept so that its figures stay reproducible; the language-model protocol is
# experiments/r4.sh. R4 ablations of the retriever on R3's language-modelling task
# (configs/passkey-only/ablations/): no Gumbel noise, random retrieval, plain softmax instead of
# softmax off by one; each is R3's drt-x1 recipe with one switch flipped, scored against R3's drt-x1
# on the same held-out windows from 1K to 32K (docs/results.md).
# Needs its R3 drt-x1: `bash experiments/passkey-only/r3.sh`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r4
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
MODELS=(--model runs/passkey-only/lm/drt-x1)
for model in drt-x1-no-gumbel drt-x1-random drt-x1-plain-softmax; do
    $F train "configs/passkey-only/ablations/$model.yaml" --no-progress
    MODELS+=(--model "runs/passkey-only/ablations/$model")
done
$F eval ppl "${MODELS[@]}" --corpus data/stdlib-byte --split val \
    --lengths 1k,2k,4k,8k,16k,32k --windows 8 --batch-size 1 --out "$OUT/ppl.json" --plot "$FIG/r4-ablations.png"
