#!/usr/bin/env bash
# The first protocol of docs/results.md (models trained only on passkey samples or for 150 steps;
# configs/passkey-only/), kept so that its figures stay reproducible; the language-model protocol is
# experiments/r3.sh. R3 perplexity extrapolation on held-out Python source: drt-x1 vs baselm trained
# as language models for 150 steps (1.2M tokens) on 1K-token windows (configs/passkey-only/lm/),
# scored from 1K to 32K tokens on the same held-out windows (docs/results.md).
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r3
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
for model in drt-x1 baselm; do
    $F train "configs/passkey-only/lm/$model.yaml" --no-progress
done
$F eval ppl --model runs/passkey-only/lm/drt-x1 --model runs/passkey-only/lm/baselm --corpus data/stdlib-byte --split val \
    --lengths 1k,2k,4k,8k,16k,32k --windows 8 --batch-size 1 --out "$OUT/ppl.json" --plot "$FIG/r3-ppl.png"
