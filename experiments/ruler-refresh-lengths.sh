#!/usr/bin/env bash
# Training lengths of the single-needle stage (docs/results.md, "Training lengths of the
# single-needle stage"): make ruler's third stage for drt-x2 (configs/lm/ruler/refresh/drt-x2.yaml,
# 1K -> 4K, 8K tokens a step) against the same stage with 16K tokens a step at 1K -> 4K
# (configs/lm/ruler/refresh-lengths/drt-x2-4k.yaml) and at 1K -> 4K -> 16K (drt-x2-16k.yaml), all
# three from make ruler's second stage. Each run, read with 2 of its 4 chunks as make ruler reads
# it, answers the passkey at 64K and 256K on a grid of its own (seed 1, 40 trials a length: not
# the trials of make ruler's table, seed 0) and lm-eval's niah_single_1 at 4K and 16K (50 items).
# Finished runs and result files are reused. Run from the repository root.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-refresh-lengths
mkdir -p "$OUT"
bash experiments/lm-data.sh

measure() {  # RUN NAME: the passkey grid and lm-eval's niah_single_1 into $OUT/NAME-*.json
    local run=$1 name=$2 length
    [ -f "$OUT/$name-passkey.json" ] || $F eval passkey --model "$run" --retrieval-top-k 2 --lengths 64k,256k \
        --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --seed 1 --corpus data/lm-byte --dtype bf16 --out "$OUT/$name-passkey.json"
    for length in 4096 16384; do
        [ -f "$OUT/$name-lm-eval-$length.json" ] || $F eval harness --model "$run" --retrieval-top-k 2 \
            --tasks niah_single_1 --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 --dtype bf16 \
            --out "$OUT/$name-lm-eval-$length.json" --samples "$OUT/$name-lm-eval-$length-samples.jsonl"
    done
}

$F train configs/lm/ruler/stage1-drt-x2.yaml --no-progress
$F train configs/lm/ruler/composed/drt-x2.yaml --no-progress
$F train configs/lm/ruler/refresh/drt-x2.yaml --no-progress
measure runs/lm/ruler/refresh/drt-x2 refresh
for name in drt-x2-4k drt-x2-16k; do
    $F train "configs/lm/ruler/refresh-lengths/$name.yaml" --no-progress
    measure "runs/lm/ruler/refresh-lengths/$name" "$name"
done
