#!/usr/bin/env bash
# Quizzes in RULER's needle haystack (docs/results.md, "Quizzes in the needle haystack"): the
# shipped models/ruler-drt-x2 trained further on needle haystacks that ask and answer questions
# about their own distractors (the niah option quizzes, docs/ruler.md): 1,200 steps at 1K -> 4K
# tokens (configs/lm/ruler/quizzes/drt-x2.yaml), then 2,000 more with more quizzes, by the
# language-modelling loss alone (drt-x2-more.yaml) or with every quiz a target of supervised
# retrieval (drt-x2-supervised.yaml). The start and each run answer farsight's niah_multikey_2 and
# niah_single_1 in RULER's wording (never trained) at 1K, 4K and 16K tokens, and lm-eval's own
# niah_multikey_2 and niah_single_1 at 4K (50 items), reading 2 chunks as make ruler's models do.
# Finished runs and result files are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-quizzes
mkdir -p "$OUT"
bash experiments/lm-data.sh
[ -f models/ruler-drt-x2/config.json ] || { echo "models/ruler-drt-x2 is missing: run make ruler first" >&2; exit 1; }
READING=(--retrieval-top-k 2)
GRID=(--tasks niah_multikey_2,niah_single_1 --lengths 1k,4k,16k --depths 0.1,0.5,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)

measure() {  # MODEL NAME: farsight's grid and lm-eval's two needle tasks at 4K into $OUT/NAME-*.json
    local model=$1 name=$2
    [ -f "$OUT/$name.json" ] || $F eval ruler --model "$model" "${READING[@]}" "${GRID[@]}" --out "$OUT/$name.json"
    [ -f "$OUT/$name-lm-eval-4096.json" ] || $F eval harness --model "$model" "${READING[@]}" \
        --tasks niah_single_1,niah_multikey_2 --metadata '{"max_seq_lengths": [4096]}' --limit 50 --dtype bf16 \
        --out "$OUT/$name-lm-eval-4096.json" --samples "$OUT/$name-lm-eval-4096-samples.jsonl"
}

measure models/ruler-drt-x2 shipped
for name in drt-x2 drt-x2-more drt-x2-supervised; do
    $F train "configs/lm/ruler/quizzes/$name.yaml" --no-progress
    measure "runs/lm/ruler/quizzes/$name" "$name"
done
