#!/usr/bin/env bash
# RULER on byte-level models trained on a CPU (make ruler). drt-x2, drt-x1 and baselm-2l start from
# the shipped base models (models/base-*, the language-model pre-trainings of configs/lm/pretrain/)
# and take one three-stage recipe: passkeys from 128 tokens (configs/lm/ruler/stage1-<model>.yaml),
# then the RULER mix to 4K with a fifth of the needles right before their question and the NIAH
# families in the composed wording (configs/lm/ruler/composed/<model>.yaml), then the same mix with
# passkeys and single needles weighted up (configs/lm/ruler/refresh/<model>.yaml). Each fine-tune is
# exported to models/ruler-<model> (bf16, checksums), and everything below reads those
# directories, so a fresh clone measures the shipped weights without training. The DRTs read
# READ_TOP_K of their 4 retrieved chunks per chunk (--retrieval-top-k; docs/results.md, "Reading
# fewer chunks than trained with").
# Every model answers lm-eval's own offline RULER tasks (their items, templates and scoring; lm-eval
# builds them with the model's byte tokenizer) at LENGTHS tokens, LIMIT items per task and length,
# through `farsight eval harness`: first the needle tasks the shipped model is held to (GATED), with
# two in-span checks (R1's passkey inside every window, and farsight's niah_single_1 right before
# RULER's question) and farsight's passkey from 1K to 1M (for the DRTs also with each needle at its
# own offset within a chunk), for every model; then the shipped
# drt-x2 through lm-eval's standard `hf` model (HF_TASKS at HF_LENGTHS); then the other tasks
# (OTHERS) for every model. Each `farsight eval harness` call also writes its items' targets
# and answers (`--samples`, JSON lines). Where the run of drt-x2 is present, its export is written
# again at the end with a model card holding the scores measured by then.
# Finished runs, exports and result files are reused, so a second call only does what is missing.
# Run from the repository root. LENGTHS, LIMIT, GATED, OTHERS, HF_TASKS, HF_LENGTHS and MODELS
# narrow a quick check (OTHERS= or HF_TASKS= set empty skips those calls; OUT and MODELS_DIR
# redirect its files).
set -euo pipefail
F=.venv/bin/farsight
OUT=${OUT:-results/ruler}
MODELS_DIR=${MODELS_DIR:-models}
LENGTHS=${LENGTHS:-4096,16384,65536,131072}
LIMIT=${LIMIT:-50}
READ_TOP_K=${READ_TOP_K:-2}
# lm-eval's offline RULER tasks but ruler_vt, whose few-shot example (893 byte tokens at its
# smallest) never fits the 500 tokens lm-eval builds it in (farsight eval harness refuses it)
GATED=${GATED:-niah_single_1,niah_multikey_2}
OTHERS=${OTHERS-niah_multikey_3,ruler_cwe,ruler_fwe}
HF_TASKS=${HF_TASKS-niah_single_1,niah_multikey_2}
HF_LENGTHS=${HF_LENGTHS:-$LENGTHS}
read -r -a MODELS <<< "${MODELS:-drt-x2 drt-x1 baselm-2l}"
mkdir -p "$OUT"
bash experiments/lm-data.sh

# farsight's passkey grid, 40 trials a length to 64K (--long-trials sets those beyond)
PASSKEY_GRID=(--lengths 1k,4k,16k,64k,256k,1m --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)

reading() {  # MODEL: the options that make a DRT read READ_TOP_K chunks (none for the baseline)
    [[ $1 == drt-* ]] && echo "--retrieval-top-k $READ_TOP_K" || true
}

for model in "${MODELS[@]}"; do
    dir=$MODELS_DIR/ruler-$model
    [ -f "$dir/config.json" ] && continue
    [ -f "models/base-$model/config.json" ] || { echo "models/base-$model is missing" >&2; exit 1; }
    $F train "configs/lm/ruler/stage1-$model.yaml" --no-progress
    $F train "configs/lm/ruler/composed/$model.yaml" --no-progress
    $F train "configs/lm/ruler/refresh/$model.yaml" --no-progress
    $F export "runs/lm/ruler/refresh/$model" "$dir" --dtype bf16 --card
done

lm_eval() {  # MODEL TASKS NAME: lm-eval's TASKS at each length into $OUT/MODEL-NAME-LENGTH.json
    local model=$1 tasks=$2 name=$3 length todo
    for length in ${LENGTHS//,/ }; do
        # below 8K, ruler_cwe's smallest item (about 7K byte tokens) does not fit: lm-eval would
        # build it with no words (farsight eval harness refuses it). One call per length: lm-eval's
        # --limit takes a task's first items, which are all of its first length.
        todo=$tasks
        [ "$length" -ge 8192 ] || todo=$(echo "$tasks" | tr , '\n' | grep -vx ruler_cwe | paste -sd, || true)
        [ -z "$todo" ] || [ -f "$OUT/$model-$name-$length.json" ] || $F eval harness --model "$MODELS_DIR/ruler-$model" \
            $(reading "$model") --tasks "$todo" --metadata "{\"max_seq_lengths\": [$length]}" --limit "$LIMIT" \
            --dtype bf16 --out "$OUT/$model-$name-$length.json" --samples "$OUT/$model-$name-$length-samples.jsonl"
    done
}

for model in "${MODELS[@]}"; do
    dir=$MODELS_DIR/ruler-$model
    lm_eval "$model" "$GATED" lm-eval
    # farsight's niah_single_1 with the needle right before RULER's long question (depth 1), about
    # 120 tokens before the answer: in a DRT's reach, two 64-token windows away for the baseline
    [ -f "$OUT/$model-inspan.json" ] || $F eval ruler --model "$dir" $(reading "$model") --tasks niah_single_1 \
        --haystack noise --lengths 4k --depths 1 --trials 50 --align 1 --dtype bf16 --out "$OUT/$model-inspan.json"
    # the in-span check of R1: the passkey right before a short question (depth 1, about 45 tokens
    # before the answer), inside every model's window
    [ -f "$OUT/$model-inspan-passkey.json" ] || $F eval passkey --model "$dir" $(reading "$model") --lengths 1k,4k \
        --depths 1 --trials 50 --corpus data/lm-byte --align 1 --dtype bf16 --batch-size 2 \
        --out "$OUT/$model-inspan-passkey.json"
    # the passkey from 1K to 1M tokens, in the corpus's held-out text
    [ -f "$OUT/$model-passkey.json" ] || $F eval passkey --model "$dir" $(reading "$model") "${PASSKEY_GRID[@]}" \
        --long-trials 2 --out "$OUT/$model-passkey.json"
    # the same grid with each trial's needle at its own offset within a 32-token chunk
    # (--needle-jitter): above, every trial of a cell holds its needle at one offset, so a cell tests
    # only passkeys split over two chunks or only whole ones; 20 trials at 256K and 1M. Not run for
    # the baseline, which has no chunks.
    if [[ $model == drt-* ]] && [ ! -f "$OUT/$model-passkey-jitter.json" ]; then
        $F eval passkey --model "$dir" $(reading "$model") "${PASSKEY_GRID[@]}" --long-trials 4 --needle-jitter 32 \
            --out "$OUT/$model-passkey-jitter.json"
    fi
done

if [[ " ${MODELS[*]} " == *" drt-x2 "* ]]; then
    # the shipped directory through lm-eval's standard "hf" model (transformers + farsight's Auto
    # classes), one task and length a call (experiments/lm_eval_hf.py)
    for length in ${HF_LENGTHS//,/ }; do
        for task in ${HF_TASKS//,/ }; do
            out=$OUT/drt-x2-hf-$task-$length.json
            [ -f "$out" ] && continue
            .venv/bin/python experiments/lm_eval_hf.py "$MODELS_DIR/ruler-drt-x2" "$task" "$length" "$LIMIT" "$READ_TOP_K" "$out"
        done
    done
fi

for model in "${MODELS[@]}"; do
    lm_eval "$model" "$OTHERS" lm-eval-others
done

# the card: the passkey, lm-eval's scores at each length, and the answers at the longest
if [[ " ${MODELS[*]} " == *" drt-x2 "* ]] && [ -d runs/lm/ruler/refresh/drt-x2 ]; then
    files=("$OUT/drt-x2-passkey.json")
    for length in ${LENGTHS//,/ }; do files+=("$OUT/drt-x2-lm-eval-$length.json" "$OUT/drt-x2-lm-eval-others-$length.json"); done
    files+=("$OUT/drt-x2-lm-eval-${LENGTHS##*,}-samples.jsonl")
    scores=()
    for file in "${files[@]}"; do
        if [ -f "$file" ]; then scores+=("$file"); fi
    done
    $F export runs/lm/ruler/refresh/drt-x2 "$MODELS_DIR/ruler-drt-x2" --dtype bf16 --card \
        --results "${scores[@]}" --sample "The grass is green."
fi
