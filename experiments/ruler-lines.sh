#!/usr/bin/env bash
# Needles one to a line (docs/results.md, "Needles one to a line"): the supervised quizzes of
# experiments/ruler-quizzes.sh (quizzes/drt-x2-supervised-long: 4,000 steps at 2K -> 4K tokens from
# models/ruler-drt-x2) with half of the needle haystacks laid out as RULER's, one needle a line
# (configs/lm/ruler/lines/lines-long.yaml), then 1,200 steps of the 8K -> 16K continuation of
# quizzes/drt-x2-supervised-16k from it (lines-16k.yaml). Each run answers farsight's grid
# (experiments/ruler-measure.sh), lm-eval's niah_single_1 and niah_multikey_2 at 4K and 16K, and lm-eval's
# niah_multikey_2 items changed in their layout or needle wording (experiments/lm-eval-variants/).
# Finished runs and result files are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-lines
source experiments/ruler-measure.sh

for name in lines-long lines-16k; do
    $F train "configs/lm/ruler/lines/$name.yaml" --no-progress
    mkdir -p "results/runs/lm/ruler/lines/$name"  # the run's config and metrics beside its records
    cp "runs/lm/ruler/lines/$name"/{config.yaml,metrics.jsonl} "results/runs/lm/ruler/lines/$name/"
    measure "runs/lm/ruler/lines/$name" "$name" 16384
    # farsight's grid with one needle a line (the run's training layout, RULER's wording)
    [ -f "$OUT/$name-lines.json" ] || $F eval ruler --model "runs/lm/ruler/lines/$name" "${READING[@]}" "${GRID[@]}" \
        --tasks niah_multikey_2 --task-option lines=1 --out "$OUT/$name-lines.json"
    # lm-eval's own niah_multikey_2 items with their needles run on as a paragraph, worded as
    # farsight's, or both
    [ -f "$OUT/$name-lm-eval-layout-4096.json" ] || $F eval harness --model "runs/lm/ruler/lines/$name" \
        "${READING[@]}" --include-path experiments/lm-eval-variants \
        --tasks niah_multikey_2_spaced,niah_multikey_2_needle,niah_multikey_2_spaced_needle \
        --metadata '{"max_seq_lengths": [4096]}' --limit 50 --dtype bf16 --out "$OUT/$name-lm-eval-layout-4096.json" \
        --samples "$OUT/$name-lm-eval-layout-4096-samples.jsonl"
done
