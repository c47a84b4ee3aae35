#!/usr/bin/env bash
# Quizzes in RULER's needle haystack (docs/results.md, "Quizzes in the needle haystack"): the
# shipped models/ruler-drt-x2 trained further on needle haystacks that ask and answer questions
# about their own distractors (the niah option quizzes, docs/ruler.md): 1,200 steps at 1K -> 4K
# tokens (configs/lm/ruler/quizzes/drt-x2.yaml), then 2,000 more with more quizzes, by the
# language-modelling loss alone (drt-x2-more.yaml) or with every quiz a target of supervised
# retrieval (drt-x2-supervised.yaml). Then the supervised recipe straight from the shipped model
# for 4,000 steps (drt-x2-supervised-long.yaml), that run continued for 2,000 steps at 8K -> 16K
# tokens (drt-x2-supervised-16k.yaml) and that one for 800 steps at 32K -> 64K
# (drt-x2-supervised-64k.yaml). The start and each run answer farsight's niah_multikey_2 and
# niah_single_1 in RULER's wording (never trained) at 1K, 4K and 16K tokens, and lm-eval's own
# niah_multikey_2 and niah_single_1 at 4K (50 items), the last three runs also at 16K, 64K and
# 128K, reading 2 chunks as make ruler's models do. Finished runs and result files
# are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-quizzes
mkdir -p "$OUT"
bash experiments/lm-data.sh
[ -f models/ruler-drt-x2/config.json ] || { echo "models/ruler-drt-x2 is missing: run make ruler first" >&2; exit 1; }
READING=(--retrieval-top-k 2)
GRID=(--tasks niah_multikey_2,niah_single_1 --lengths 1k,4k,16k --depths 0.1,0.5,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)

measure() {  # MODEL NAME [LENGTH...]: farsight's grid, and lm-eval's two needle tasks at 4K and
    # each LENGTH (one call a length), into $OUT/NAME-*.json
    local model=$1 name=$2 length
    shift 2
    [ -f "$OUT/$name.json" ] || $F eval ruler --model "$model" "${READING[@]}" "${GRID[@]}" --out "$OUT/$name.json"
    for length in 4096 "$@"; do
        [ -f "$OUT/$name-lm-eval-$length.json" ] || $F eval harness --model "$model" "${READING[@]}" \
            --tasks niah_single_1,niah_multikey_2 --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 \
            --dtype bf16 --out "$OUT/$name-lm-eval-$length.json" --samples "$OUT/$name-lm-eval-$length-samples.jsonl"
    done
}

measure models/ruler-drt-x2 shipped
for name in drt-x2 drt-x2-more drt-x2-supervised; do
    $F train "configs/lm/ruler/quizzes/$name.yaml" --no-progress
    measure "runs/lm/ruler/quizzes/$name" "$name"
done
for name in drt-x2-supervised-long drt-x2-supervised-16k drt-x2-supervised-64k; do
    $F train "configs/lm/ruler/quizzes/$name.yaml" --no-progress
    measure "runs/lm/ruler/quizzes/$name" "$name" 16384 65536 131072
done
# the last run on make ruler's passkey grid, 1K to 1M tokens
[ -f "$OUT/drt-x2-supervised-64k-passkey.json" ] || $F eval passkey --model runs/lm/ruler/quizzes/drt-x2-supervised-64k \
    "${READING[@]}" --lengths 1k,4k,16k,64k,256k,1m --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --long-trials 2 \
    --corpus data/lm-byte --dtype bf16 --out "$OUT/drt-x2-supervised-64k-passkey.json"
