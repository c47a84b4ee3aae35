#!/usr/bin/env bash
# The first protocol of docs/results.md (stops up to 23; models trained only on passkey samples or
# for 150 steps), kept so that its figures stay reproducible; issue 18's protocol is experiments/r1.sh.
# R1 passkey retrieval vs context length: DRT (G=1, the first demo model's recipe, configs/passkey-drt.yaml, and G=2) vs BaseLM
# (sliding window + ALiBi) vs standard causal attention; same size, data and training tokens,
# trained at 1K tokens, evaluated from 1K to 1M on held-out Python source (docs/results.md).
# Run from the repository root: `bash experiments/passkey-only/r1.sh` (trains what is missing; a finished run is reused).
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r1
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
for config in passkey-drt r1-drt-g2 r1-baselm r1-causal; do
    $F train "configs/$config.yaml" --no-progress
done
# 5 depths x 10 trials = 50 per length up to 64K, 5 x 4 = 20 beyond
GRID=(--depths 0,0.25,0.5,0.75,1 --trials 10 --long-trials 4 --batch-size 2 --corpus data/stdlib-byte --split val)
$F eval passkey --model runs/passkey-drt --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --out "$OUT/drt-g1.json" --plot "$FIG/r1-drt-g1.png"
# G=2 with 10 trials per length up to 64K and 5 beyond (the session's CPU budget; G=1 is the headline)
$F eval passkey --model runs/r1-drt-g2 --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --trials 2 --long-trials 1 \
    --out "$OUT/drt-g2.json" --plot "$FIG/r1-drt-g2.png"
$F eval passkey --model runs/r1-baselm --lengths 1k,4k,16k,64k,256k,1m "${GRID[@]}" --out "$OUT/baselm.json"
# full attention costs O(L^2) per sequence: measured up to 16K only
$F eval passkey --model runs/r1-causal --lengths 1k,4k,16k "${GRID[@]}" --out "$OUT/causal.json"
$F eval compare "$OUT"/drt-g1.json "$OUT"/drt-g2.json "$OUT"/baselm.json "$OUT"/causal.json \
    --labels "DRT G=1,DRT G=2,BaseLM,causal" --plot "$FIG/r1-passkey.png" --title "R1: passkey exact match vs length (trained at 1K)"
