#!/usr/bin/env bash
# Needles one to a line (docs/results.md, "Needles one to a line"): the supervised quizzes of
# experiments/ruler-quizzes.sh (quizzes/drt-x2-supervised-long: 4,000 steps at 2K -> 4K tokens from
# models/ruler-drt-x2) with half of the needle haystacks laid out as RULER's, one needle a line
# (configs/lm/ruler/lines/lines-long.yaml), then 1,200 steps of the 8K -> 16K continuation of
# quizzes/drt-x2-supervised-16k from it (lines-16k.yaml), exported to models/ruler-drt-x2-lines
# (bf16, checksums, a card with the scores below). Each run answers farsight's grid
# (experiments/ruler-measure.sh), lm-eval's niah_single_1 and niah_multikey_2 at 4K and 16K, and
# lm-eval's niah_multikey_2 items changed in their layout or needle wording
# (experiments/lm-eval-variants/); the shipped directory also lm-eval's two needle tasks at 64K and
# 128K, the same tasks through lm-eval's standard "hf" model at 4K-128K, the passkey from 1K to 1M,
# and lm-eval's other offline RULER tasks at 4K-128K. Finished runs, exports and result files are
# reused, so a fresh clone measures the shipped weights without training. Run from the repository
# root after experiments/ruler.sh (make ruler runs both).
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-lines
SHIPPED=models/ruler-drt-x2-lines
source experiments/ruler-measure.sh

train() {  # NAME: configs/lm/ruler/lines/<name>.yaml, its config and metrics copied beside its records
    $F train "configs/lm/ruler/lines/$1.yaml" --no-progress
    mkdir -p "results/runs/lm/ruler/lines/$1"
    cp "runs/lm/ruler/lines/$1"/{config.yaml,metrics.jsonl} "results/runs/lm/ruler/lines/$1/"
}

variants() {  # MODEL NAME: farsight's grid with one needle a line (the runs' training layout, RULER's
    # wording), and lm-eval's own niah_multikey_2 items with their needles run on as a paragraph,
    # worded as farsight's, or both
    [ -f "$OUT/$2-lines.json" ] || $F eval ruler --model "$1" "${READING[@]}" "${GRID[@]}" \
        --tasks niah_multikey_2 --task-option lines=1 --out "$OUT/$2-lines.json"
    [ -f "$OUT/$2-lm-eval-layout-4096.json" ] || $F eval harness --model "$1" "${READING[@]}" \
        --include-path experiments/lm-eval-variants \
        --tasks niah_multikey_2_spaced,niah_multikey_2_needle,niah_multikey_2_spaced_needle \
        --metadata '{"max_seq_lengths": [4096]}' --limit 50 --dtype bf16 --out "$OUT/$2-lm-eval-layout-4096.json" \
        --samples "$OUT/$2-lm-eval-layout-4096-samples.jsonl"
}

# lines-long is lines-16k's start; its own records are measured last below
if [ ! -f "$SHIPPED/config.json" ] || [ ! -f "$OUT/lines-long-lm-eval-layout-4096.json" ]; then train lines-long; fi
if [ ! -f "$SHIPPED/config.json" ]; then
    train lines-16k
    $F export runs/lm/ruler/lines/lines-16k "$SHIPPED" --dtype bf16 --card
fi

measure "$SHIPPED" lines-16k 16384 65536 131072
passkey_grid "$SHIPPED" lines-16k
# lm-eval's standard "hf" model on the shipped directory, one task and length a call
for length in 4096 16384 65536 131072; do
    for task in niah_single_1 niah_multikey_2; do
        out=$OUT/lines-16k-hf-$task-$length.json
        [ -f "$out" ] || .venv/bin/python experiments/lm_eval_hf.py "$SHIPPED" "$task" "$length" 50 2 "$out"
    done
done
variants "$SHIPPED" lines-16k

measure runs/lm/ruler/lines/lines-long lines-long 16384
variants runs/lm/ruler/lines/lines-long lines-long

# lm-eval's other offline RULER tasks on the shipped directory, as experiments/ruler.sh runs them
# (ruler_cwe from 8K: its smallest item does not fit in 4K byte tokens)
for length in 4096 16384 65536 131072; do
    tasks=niah_multikey_3,ruler_fwe
    [ "$length" -lt 8192 ] || tasks=niah_multikey_3,ruler_cwe,ruler_fwe
    [ -f "$OUT/lines-16k-lm-eval-others-$length.json" ] || $F eval harness --model "$SHIPPED" "${READING[@]}" \
        --tasks "$tasks" --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 --dtype bf16 \
        --out "$OUT/lines-16k-lm-eval-others-$length.json" --samples "$OUT/lines-16k-lm-eval-others-$length-samples.jsonl"
done

# the card: the passkey, lm-eval's scores at each length, and the answers at the longest
if [ -d runs/lm/ruler/lines/lines-16k ]; then
    scores=()
    for file in "$OUT/lines-16k-passkey.json" "$OUT"/lines-16k-lm-eval-{,others-}{4096,16384,65536,131072}.json \
        "$OUT/lines-16k-lm-eval-131072-samples.jsonl"; do
        if [ -f "$file" ]; then scores+=("$file"); fi
    done
    $F export runs/lm/ruler/lines/lines-16k "$SHIPPED" --dtype bf16 --card --results "${scores[@]}" \
        --sample "The grass is green."
fi
