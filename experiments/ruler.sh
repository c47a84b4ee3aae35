#!/usr/bin/env bash
# RULER on byte-level models trained on a CPU (make ruler). drt-x2, drt-x1 and baselm-2l start from
# the shipped base models (models/base-*, the language-model pre-trainings of configs/lm/pretrain/)
# and take one two-stage recipe: passkeys from 128 tokens (configs/lm/ruler/stage1-<model>.yaml),
# then the RULER mix in varied wordings to 4K (configs/lm/ruler/<model>.yaml). The fine-tuned drt-x2
# is exported to models/ruler-drt-x2. Then every model answers lm-eval's own offline RULER tasks
# (their items, templates and scoring; lm-eval builds them with the model's byte tokenizer) at
# LENGTHS tokens, LIMIT items per task and length, through `farsight eval harness`, and the
# shipped model also through lm-eval's standard `hf` model (HF_TASKS: by default the two needle
# tasks, as it runs about 4x slower than farsight's model on a CPU); two in-span checks (R1's
# passkey inside every window, and farsight's niah_single_1 right before RULER's question); and
# farsight's passkey from 1K to 1M. Each lm-eval call also writes its items' targets and answers
# (`--samples`, JSON lines).
# Finished runs and result files are reused, so a second call only does what is missing.
# Run from the repository root. LENGTHS, LIMIT, TASKS, HF_TASKS, HF_LENGTHS and MODELS narrow a quick check
# (OUT and SHIPPED redirect its files).
set -euo pipefail
F=.venv/bin/farsight
OUT=${OUT:-results/ruler}
LENGTHS=${LENGTHS:-4096,16384,65536,131072}
LIMIT=${LIMIT:-50}
# lm-eval's offline RULER tasks but ruler_vt, whose few-shot example (893 byte tokens at its
# smallest) never fits the 500 tokens lm-eval builds it in (farsight eval harness refuses it)
TASKS=${TASKS:-niah_single_1,niah_multikey_2,niah_multikey_3,ruler_cwe,ruler_fwe}
HF_TASKS=${HF_TASKS:-niah_single_1,niah_multikey_2}
HF_LENGTHS=${HF_LENGTHS:-$LENGTHS}
read -r -a MODELS <<< "${MODELS:-drt-x2 drt-x1 baselm-2l}"
SHIPPED=${SHIPPED:-models/ruler-drt-x2}
mkdir -p "$OUT"
bash experiments/lm-data.sh

for model in "${MODELS[@]}"; do
    [ -f "models/base-$model/config.json" ] || { echo "models/base-$model is missing" >&2; exit 1; }
    $F train "configs/lm/ruler/stage1-$model.yaml" --no-progress
    $F train "configs/lm/ruler/$model.yaml" --no-progress
done

for model in "${MODELS[@]}"; do
    # lm-eval's RULER tasks through farsight's lm-eval model (streaming sessions, any length), one
    # call per length: lm-eval's --limit takes a task's first items, which are all of its first length
    for length in ${LENGTHS//,/ }; do
        # below 8K, ruler_cwe's smallest item (about 7K byte tokens) does not fit: lm-eval would
        # build it with no words (farsight eval harness refuses it)
        tasks=$TASKS
        [ "$length" -ge 8192 ] || tasks=$(echo "$TASKS" | tr , '\n' | grep -vx ruler_cwe | paste -sd,)
        [ -f "$OUT/$model-lm-eval-$length.json" ] || $F eval harness --model "runs/lm/ruler/$model" --tasks "$tasks" \
            --metadata "{\"max_seq_lengths\": [$length]}" --limit "$LIMIT" --dtype bf16 --out "$OUT/$model-lm-eval-$length.json" \
            --samples "$OUT/$model-lm-eval-$length-samples.jsonl"
    done
    # farsight's niah_single_1 with the needle right before RULER's long question (depth 1), about
    # 120 tokens before the answer: in a DRT's reach, two 64-token windows away for the baseline
    [ -f "$OUT/$model-inspan.json" ] || $F eval ruler --model "runs/lm/ruler/$model" --tasks niah_single_1 \
        --haystack noise --lengths 4k --depths 1 --trials 50 --align 1 --dtype bf16 --out "$OUT/$model-inspan.json"
    # the in-span check of R1: the passkey right before a short question (depth 1, about 45 tokens
    # before the answer), inside every model's window
    [ -f "$OUT/$model-inspan-passkey.json" ] || $F eval passkey --model "runs/lm/ruler/$model" --lengths 1k,4k \
        --depths 1 --trials 50 --corpus data/lm-byte --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/$model-inspan-passkey.json"
    # the passkey from 1K to 1M tokens, in the corpus's held-out text
    [ -f "$OUT/$model-passkey.json" ] || $F eval passkey --model "runs/lm/ruler/$model" \
        --lengths 1k,4k,16k,64k,256k,1m --depths 0.1,0.5,0.9 --trials 4 --long-trials 1 \
        --corpus data/lm-byte --dtype bf16 --out "$OUT/$model-passkey.json"
done

if [[ " ${MODELS[*]} " == *" drt-x2 "* ]]; then
    # the card: the passkey, lm-eval's scores at each length, and the answers at the longest
    scores=("$OUT/drt-x2-passkey.json")
    for length in ${LENGTHS//,/ }; do scores+=("$OUT/drt-x2-lm-eval-$length.json"); done
    scores+=("$OUT/drt-x2-lm-eval-${LENGTHS##*,}-samples.jsonl")
    [ -f "$SHIPPED/config.json" ] || $F export runs/lm/ruler/drt-x2 "$SHIPPED" --dtype bf16 --card \
        --results "${scores[@]}" --sample "The grass is green."
    # the shipped directory through lm-eval's standard "hf" model (transformers + farsight's Auto classes)
    for length in ${HF_LENGTHS//,/ }; do
        [ -f "$OUT/drt-x2-hf-$length.json" ] || .venv/bin/python - "$SHIPPED" "$HF_TASKS" "$length" "$LIMIT" \
            "$OUT/drt-x2-hf-$length.json" <<'EOF'
import json, sys

import lm_eval
import torch

import farsight.hf  # noqa: F401  (registers farsight's classes with transformers' Auto classes)

directory, tasks, length, limit, out = sys.argv[1:]
device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's hf model assumes CUDA otherwise
result = lm_eval.simple_evaluate(
    model="hf", model_args=f"pretrained={directory},dtype=bfloat16,device={device}", tasks=tasks.split(","),
    metadata={"max_seq_lengths": [int(length)]}, limit=int(limit),
)
with open(out, "w") as handle:
    json.dump({"lm_eval": lm_eval.__version__, "results": result["results"]}, handle, indent=1, default=str)
EOF
    done
fi
