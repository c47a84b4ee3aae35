#!/usr/bin/env bash
# The first protocol of docs/results.md (models trained only on passkey samples or for 150 steps;
# configs/passkey-only/), kept so that its figures stay reproducible; the language-model protocol is
# experiments/r2.sh. R2 2-hop NIAH with distractor chains: drt-x2 vs drt-x1 vs baselm, each
# fine-tuned from its R1 model for 100 steps on 2-hop chains and passkeys at 1K tokens
# (configs/passkey-only/niah2hop/; docs/results.md). Needs its R1 runs: `bash experiments/passkey-only/r1.sh`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r2
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
for model in drt-x1 drt-x2 baselm; do
    $F train "configs/passkey-only/niah2hop/$model.yaml" --no-progress
done
# 3 depths x 4 trials = 12 per length, 1K to 64K
GRID=(--lengths 1k,4k,16k,64k --depths 0,0.5,1 --trials 4 --batch-size 2
      --task-option distractors=2 --corpus data/stdlib-byte --split val)
for model in drt-x2 drt-x1 baselm; do
    $F eval niah2hop --model "runs/passkey-only/niah2hop/$model" "${GRID[@]}" --out "$OUT/$model.json"
done
$F eval compare "$OUT"/drt-x2.json "$OUT"/drt-x1.json "$OUT"/baselm.json --labels "drt-x2,drt-x1,baselm" \
    --plot "$FIG/r2-niah2hop.png" --title "R2: 2-hop NIAH exact match vs length (trained at 1K)"
