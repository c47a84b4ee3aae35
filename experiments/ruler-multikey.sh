#!/usr/bin/env bash
# Multi-key needles, supervised retrieval and aligned questions (docs/results.md, "RULER's
# multi-key needles on a byte-level model"): from the composed RULER mix of
# experiments/ruler-near.sh (runs/lm/ruler/near/drt-x2-composed-seed2), 700 steps of multi-key and
# single needles at 512 -> 1K tokens four ways (configs/lm/ruler/multikey/5-mix.yaml and three
# variants): questions at any offset or ending on chunk boundaries, each with and without
# supervised retrieval. Each run and the composed start then answer farsight's niah_multikey_2 and
# niah_single_1 at 512, 1K and 4K tokens. Finished runs and result files are reused. Run from the
# repository root.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-multikey
mkdir -p "$OUT"
bash experiments/lm-data.sh
$F train configs/lm/ruler/stage1-drt-x2.yaml --no-progress
$F train configs/lm/ruler/near/drt-x2-composed-seed2.yaml --no-progress
GRID=(--tasks niah_multikey_2,niah_single_1 --lengths 512,1k,4k --depths 0.1,0.5,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)
[ -f "$OUT/drt-x2-composed-seed2.json" ] || $F eval ruler --model runs/lm/ruler/near/drt-x2-composed-seed2 "${GRID[@]}" \
    --out "$OUT/drt-x2-composed-seed2.json"
for name in 5-mix 5-mix-supervised 5-mix-aligned 5-mix-aligned-supervised; do
    $F train "configs/lm/ruler/multikey/$name.yaml" --no-progress
    [ -f "$OUT/$name.json" ] || $F eval ruler --model "runs/lm/ruler/multikey/$name" "${GRID[@]}" --out "$OUT/$name.json"
done
