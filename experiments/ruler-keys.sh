#!/usr/bin/env bash
# Keys the model cannot learn by heart (docs/results.md, "Keys the model cannot learn by heart"):
# the supervised quizzes of experiments/ruler-quizzes.sh with other keys in the needle haystacks
# (configs/lm/ruler/keys/): coined keys (made-up word pairs, passkeys weighted 2) for 2,500 steps
# at 2K -> 4K tokens and 1,200 more at 8K -> 16K; English keys (pairs from 8,000 words) for the
# 4,000 steps of quizzes/drt-x2-supervised-long. Each run answers farsight's grid
# (experiments/ruler-measure.sh) in RULER's wording with its listed keys and again with the
# run's own kind of keys, and lm-eval's niah_single_1 and niah_multikey_2 at 4K; coined-16k also
# lm-eval's niah_multikey_2 items with their keys swapped for each of farsight's kinds.
# Finished runs and result files are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-keys
source experiments/ruler-measure.sh

for name in coined-long coined-16k english-long; do
    $F train "configs/lm/ruler/keys/$name.yaml" --no-progress
    mkdir -p "results/runs/lm/ruler/keys/$name"  # the run's config and metrics beside its records
    cp "runs/lm/ruler/keys/$name"/{config.yaml,metrics.jsonl} "results/runs/lm/ruler/keys/$name/"
    measure "runs/lm/ruler/keys/$name" "$name"
    kind=${name%%-*}  # the run's own keys: coined or english
    [ -f "$OUT/$name-$kind.json" ] || $F eval ruler --model "runs/lm/ruler/keys/$name" "${READING[@]}" "${GRID[@]}" \
        --task-option "key_kind=$kind" --out "$OUT/$name-$kind.json"
done
# lm-eval's own niah_multikey_2 items with their keys swapped for farsight's kinds (experiments/lm-eval-variants/)
[ -f "$OUT/coined-16k-lm-eval-swapped-4096.json" ] || $F eval harness --model runs/lm/ruler/keys/coined-16k \
    "${READING[@]}" --include-path experiments/lm-eval-variants \
    --tasks niah_multikey_2_words,niah_multikey_2_coined,niah_multikey_2_english --metadata '{"max_seq_lengths": [4096]}' \
    --limit 50 --dtype bf16 --out "$OUT/coined-16k-lm-eval-swapped-4096.json" \
    --samples "$OUT/coined-16k-lm-eval-swapped-4096-samples.jsonl"
