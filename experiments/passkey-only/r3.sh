#!/usr/bin/env bash
# The first protocol of docs/results.md (stops up to 23; models trained only on passkey samples or
# for 150 steps), kept so that its figures stay reproducible; issue 18's protocol is experiments/r3.sh.
# R3 perplexity extrapolation on held-out Python source: DRT vs BaseLM trained as language models
# for 150 steps (1.2M tokens) on 1K-token windows, scored from 1K to 32K tokens on the same held-out windows (docs/results.md).
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r3
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
for model in drt baselm; do
    $F train "configs/r3-$model.yaml" --no-progress
done
$F eval ppl --model runs/r3-drt --model runs/r3-baselm --corpus data/stdlib-byte --split val \
    --lengths 1k,2k,4k,8k,16k,32k --windows 8 --batch-size 1 --out "$OUT/ppl.json" --plot "$FIG/r3-ppl.png"
