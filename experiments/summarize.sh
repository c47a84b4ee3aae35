#!/usr/bin/env bash
# Summarization stand-in for the DRT paper's long-input fine-tune (a long article in, a short
# summary out, ROUGE): Python modules of 2K to 64K byte tokens in, the summary line of their
# docstring out (experiments/summarize-data.py; packages held out whole). Each model pre-trained as
# a language model (configs/lm/pretrain/, `make r3`) is fine-tuned with the loss on the answer only
# (configs/lm/summarize/), then answers the held-out test modules greedily: ROUGE-1/2/L and exact
# match by input length. Source text: the packages installed in .venv (not the standard library,
# which the pre-training corpus holds); the manifest records their versions.
# Run from the repository root: `make summarize` (trains what is missing; a finished run is reused).
set -euo pipefail
F=.venv/bin/farsight
DATA=data/summarize
OUT=results/summarize
mkdir -p "$OUT"
[ -f "$DATA/manifest.json" ] || .venv/bin/python experiments/summarize-data.py --source site-packages --out "$DATA"
cp "$DATA/manifest.json" "$OUT/data-manifest.json"
[ -f "$DATA-byte/meta.json" ] || $F data prepare-sft --source "$DATA/train.jsonl" --val "$DATA/val.jsonl" \
    --tokenizer byte --max-len 65536 --out "$DATA-byte"
bash experiments/lm-data.sh
# The parameter-matched pair first; each model is pre-trained, fine-tuned and scored before the next
# (30 test modules of each length bucket, spread over the test packages).
MODELS=(drt-x1 baselm-2l drt-x2 baselm)
for model in "${MODELS[@]}"; do
    $F train "configs/lm/pretrain/$model.yaml" --no-progress
    $F train "configs/lm/summarize/$model.yaml" --no-progress
    [ -f "$OUT/$model.json" ] || $F eval generate --model "runs/lm/summarize/$model" --data "$DATA/test.jsonl" \
        --max-new-tokens 200 --stop-at-newline --buckets 4k,8k,16k,32k,64k --per-bucket 30 --dtype bf16 \
        --out "$OUT/$model.json" | tee "$OUT/$model.txt"
done
# ROUGE-L by input length, a column per model; overall scores; each model against the first
# (paired bootstrap over the test modules); the figure docs/figures/summarize-rougeL.png
.venv/bin/python experiments/summarize-table.py "$OUT" "${MODELS[@]}" | tee "$OUT/rougeL.md"
