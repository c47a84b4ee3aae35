#!/usr/bin/env bash
# The first protocol of docs/results.md (models trained only on passkey samples or for 150 steps;
# configs/passkey-only/), kept so that its figures stay reproducible; the language-model protocol is
# experiments/r1.sh. R1 passkey retrieval vs context length: drt-x1 (the first demo model's recipe,
# configs/passkey-only/passkey/drt-x1.yaml) and drt-x2 vs baselm (sliding window + ALiBi) vs causal
# (standard causal attention); same size, data and training tokens, trained at 1K tokens,
# evaluated from 1K to 1M on held-out Python source (docs/results.md).
# Run from the repository root: `bash experiments/passkey-only/r1.sh` (trains what is missing; a finished run is reused).
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r1
FIG=docs/figures
R=runs/passkey-only/passkey
mkdir -p "$OUT" "$FIG"
for model in drt-x1 drt-x2 baselm causal; do
    $F train "configs/passkey-only/passkey/$model.yaml" --no-progress
done
# 5 depths x 10 trials = 50 per length up to 64K, 5 x 4 = 20 beyond
GRID=(--depths 0,0.25,0.5,0.75,1 --trials 10 --long-trials 4 --batch-size 2 --corpus data/stdlib-byte --split val)
$F eval passkey --model $R/drt-x1 --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --out "$OUT/drt-x1.json" --plot "$FIG/r1-drt-x1.png"
# drt-x2 with 10 trials per length up to 64K and 5 beyond (the CPU budget of the time; drt-x1 is the headline)
$F eval passkey --model $R/drt-x2 --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --trials 2 --long-trials 1 \
    --out "$OUT/drt-x2.json" --plot "$FIG/r1-drt-x2.png"
$F eval passkey --model $R/baselm --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --out "$OUT/baselm.json"
# full attention costs O(L^2) per sequence: measured up to 16K only
$F eval passkey --model $R/causal --lengths 1k,4k,16k "${GRID[@]}" --out "$OUT/causal.json"
$F eval compare "$OUT"/drt-x1.json "$OUT"/drt-x2.json "$OUT"/baselm.json "$OUT"/causal.json \
    --labels "drt-x1,drt-x2,baselm,causal" --plot "$FIG/r1-passkey.png" --title "R1: passkey exact match vs length (trained at 1K)"
