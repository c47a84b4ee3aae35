#!/usr/bin/env bash
# R7: a DRT that does more than the passkey. BPE models of about 13M parameters (d_model 256, 8
# layers; 8-9M without the embedding) pre-trained on long real documents (configs/bpe/pretrain/;
# corpus and 16K BPE: experiments/code-corpus.sh), fine-tuned on a retrieval mix in many wordings
# (configs/bpe/finetune/), then scored: the in-span check of the baseline, lm-eval's own RULER tasks
# at 4K-128K through `farsight eval harness`, farsight's RULER-style tasks, the passkey to 1M,
# perplexity vs length (1x-32x), and the paper's two claims (drt-x1 vs baselm-2l at parameter
# parity; G=2 vs G=1 on 2-hop NIAH).
# Hours per model on a 2-core CPU (precision auto: bf16-mixed where the CPU has bf16 matrix
# instructions); every run resumes where it stopped and a finished run is reused.
# Run from the repository root: `make r7`.
#
# Settings (environment):
#   PRETRAIN (runs/bpe/pretrain): the pre-trained runs. The default folder's runs are pre-trained
#     here (50M tokens, configs/bpe/pretrain/); from another folder, e.g. PRETRAIN=runs/gpu-pretrain
#     for the GPU pre-trainings that `experiments/gpu-pretrain.sh reassemble` wrote, the models
#     found there are scored and the others skipped.
#   MODELS ("drt-x2 baselm-2l drt-x1"): the models to fine-tune and score; the comparisons take
#     those of their models that are listed.
#   RUNS (runs/bpe): fine-tunes under RUNS/finetune.
#   OUT (results/r7), FIG_PREFIX (r7): where the records and figures go.
#   SHIP (unset): a model directory to export the fine-tuned drt-x2 to, with a model card of its
#     records (models/bpe-drt-x2 holds the GPU pre-training's).
#   LIMIT (50), LENGTHS (4096,16384,65536,131072), RULER (niah_single_1,niah_multikey_2,
#     niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe): lm-eval's RULER items per task and length, the
#     lengths, the tasks.
set -euo pipefail
F=.venv/bin/farsight
P=${PRETRAIN:-runs/bpe/pretrain}
R=${RUNS:-runs/bpe}
OUT=${OUT:-results/r7}
FIG=docs/figures
PREFIX=${FIG_PREFIX:-r7}
LIMIT=${LIMIT:-50}
LENGTHS=${LENGTHS:-4096,16384,65536,131072}
RULER=${RULER:-niah_single_1,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe}
CORPUS=data/code-bpe16k-tokens
read -r -a MODELS <<< "${MODELS:-drt-x2 baselm-2l drt-x1}"
mkdir -p "$OUT" "$FIG"
bash experiments/code-corpus.sh
has() { [[ " ${MODELS[*]} " == *" $1 "* ]]; }
if [ "$P" = runs/bpe/pretrain ]; then
    for model in "${MODELS[@]}"; do
        $F train "configs/bpe/pretrain/$model.yaml" --no-progress
    done
else
    found=()
    for model in "${MODELS[@]}"; do
        if [ -d "$P/$model/checkpoints" ]; then found+=("$model"); else echo "r7: no $P/$model, skipping $model"; fi
    done
    MODELS=("${found[@]}")
fi
for model in "${MODELS[@]}"; do
    start=$P/$model
    if [ -f "configs/bpe/finetune/stage1-$model.yaml" ]; then  # the passkey from short lengths first
        $F train "configs/bpe/finetune/stage1-$model.yaml" --no-progress \
            --set "train.init_from=$start" --set "train.out_dir=$R/finetune/stage1-$model"
        start=$R/finetune/stage1-$model
    fi
    $F train "configs/bpe/finetune/$model.yaml" --no-progress \
        --set "train.init_from=$start" --set "train.out_dir=$R/finetune/$model"
done
runs=() labels=()
for model in "${MODELS[@]}"; do runs+=("$P/$model"); labels+=("$model"); done
$F eval runs "${runs[@]}" --out "$OUT/models.json" --labels "$(IFS=,; echo "${labels[*]}")" \
    --plot "$FIG/$PREFIX-loss.png" --title "BPE pre-training: 4K windows, same order"
# perplexity on the same held-out windows from the training length (4K) to 32x
ppl=()
for run in "${runs[@]}"; do ppl+=(--model "$run"); done
$F eval ppl "${ppl[@]}" --lengths 4k,8k,16k,32k,64k,128k \
    --corpus "$CORPUS" --split val --windows 12 --window-length 128k --batch-size 1 --dtype bf16 \
    --out "$OUT/ppl.json" --plot "$FIG/$PREFIX-ppl.png"
COMMON=(--corpus "$CORPUS" --split val --align 1 --dtype bf16)
# the in-span check: a needle inside every model's window (depth 1), at the fine-tune's lengths
for model in "${MODELS[@]}"; do
    $F eval passkey --model "$R/finetune/$model" --lengths 1k,4k --depths 1 --trials 50 "${COMMON[@]}" \
        --out "$OUT/inspan-$model.json"
done
# lm-eval's own RULER tasks (their templates and items), LIMIT items per task and length, one call
# per length (lm-eval's --limit takes a task's first items, which are all of its first length)
for model in drt-x2 baselm-2l; do
    has "$model" || continue
    for length in ${LENGTHS//,/ }; do
        [ -f "$OUT/lm-eval-ruler-$model-$length.json" ] || $F eval harness --model "$R/finetune/$model" \
            --tasks "$RULER" --limit "$LIMIT" --dtype bf16 --metadata "{\"max_seq_lengths\": [$length]}" \
            --out "$OUT/lm-eval-ruler-$model-$length.json"
    done
done
if has drt-x2; then
    # farsight's RULER-style tasks (RULER's wording) in real-text haystacks, and the passkey to 1M
    $F eval ruler --model "$R/finetune/drt-x2" --tasks all --lengths 4k,16k,64k,128k --trials 10 \
        --corpus "$CORPUS" --split val --dtype bf16 --out "$OUT/ruler-drt-x2.json"
    $F eval passkey --model "$R/finetune/drt-x2" --lengths 4k,16k,64k,256k,1m --depths 0,0.25,0.5,0.75,1 \
        --trials 10 --long-trials 4 "${COMMON[@]}" --out "$OUT/passkey-drt-x2.json" --plot "$FIG/$PREFIX-passkey.png"
fi
if has drt-x2 && has drt-x1; then
    # G=2 vs G=1 on 2-hop NIAH with two distractor chains, both fine-tuned by the same recipe (drt-x1's:
    # the retrieval mix alone, so drt-x2 once more without its passkey stage): 100 samples per length
    # (a 95% interval of about +-10%)
    $F train configs/bpe/finetune/drt-x2.yaml --no-progress \
        --set "train.init_from=$P/drt-x2" --set "train.out_dir=$R/finetune/drt-x2-no-stage1"
    for model in drt-x2-no-stage1 drt-x1; do
        $F eval niah2hop --model "$R/finetune/$model" --lengths 4k,16k --depths 0,0.25,0.5,0.75,1 --trials 20 \
            --task-option distractors=2 "${COMMON[@]}" --out "$OUT/niah2hop-$model.json"
        # the chain at the end of a 1K input: can the model follow it at all?
        $F eval niah2hop --model "$R/finetune/$model" --lengths 1k --depths 1 --trials 50 \
            --task-option distractors=2 "${COMMON[@]}" --out "$OUT/niah2hop-inspan-$model.json"
    done
    # the in-span check of drt-x2 after the mix alone, the recipe of the baseline
    $F eval passkey --model "$R/finetune/drt-x2-no-stage1" --lengths 1k,4k --depths 1 --trials 50 "${COMMON[@]}" \
        --out "$OUT/inspan-drt-x2-no-stage1.json"
    $F eval compare "$OUT"/niah2hop-{drt-x2-no-stage1,drt-x1}.json --labels "drt-x2,drt-x1" | tee "$OUT/niah2hop.txt"
fi
if has drt-x2 && [ -n "${SHIP:-}" ] && [ ! -f "$SHIP/config.json" ]; then
    cards=("$OUT/ppl.json" "$OUT/inspan-drt-x2.json" "$OUT/passkey-drt-x2.json")
    for length in ${LENGTHS//,/ }; do cards+=("$OUT/lm-eval-ruler-drt-x2-$length.json"); done
    $F export "$R/finetune/drt-x2" "$SHIP" --dtype bf16 --card --results "${cards[@]}" --sample "def fibonacci(n):"
fi
