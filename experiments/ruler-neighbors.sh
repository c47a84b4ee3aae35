#!/usr/bin/env bash
# Reading the chunks beside each retrieved one (docs/results.md, "Reading the chunks beside each
# retrieved one"; docs/design.md §2.8). make ruler's DRTs read 2 of their 4 chunks; here they also
# read the chunk before and the chunk after each (--retrieval-neighbors 1): drt-x2 as shipped (the
# option at evaluation alone), and drt-x2 and drt-x1 after their third stage trained with them
# (configs/lm/ruler/neighbors/<model>.yaml, from the same second stage). Each answers make ruler's
# passkey grid with jittered needles (1K to 1M, 40 trials a length to 64K, 20 at 256K and 1M: the
# trials of results/ruler/<model>-passkey-jitter.json) and lm-eval's niah_single_1 at 4K and 16K and
# niah_multikey_2 at 4K (50 items); the trained drt-x2 also make ruler's passkey grid by depth
# alone, the passkey grid of experiments/ruler-refresh-lengths.sh and niah_single_1 at 64K and
# 128K. Finished runs and result files are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-neighbors
mkdir -p "$OUT"
bash experiments/lm-data.sh
READING=(--retrieval-top-k 2 --retrieval-neighbors 1)
# make ruler's passkey grid (experiments/ruler.sh)
PASSKEY_GRID=(--lengths 1k,4k,16k,64k,256k,1m --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)

measure() {  # MODEL NAME LENGTHS: the passkey grid and lm-eval's tasks into $OUT/NAME-*.json
    local model=$1 name=$2 lengths=$3 length tasks
    [ -f "$OUT/$name-passkey-jitter.json" ] || $F eval passkey --model "$model" "${READING[@]}" "${PASSKEY_GRID[@]}" \
        --long-trials 4 --needle-jitter 32 --out "$OUT/$name-passkey-jitter.json"
    for length in ${lengths//,/ }; do
        tasks=niah_single_1
        [ "$length" -gt 4096 ] || tasks=niah_single_1,niah_multikey_2
        [ -f "$OUT/$name-lm-eval-$length.json" ] || $F eval harness --model "$model" "${READING[@]}" \
            --tasks "$tasks" --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 --dtype bf16 \
            --out "$OUT/$name-lm-eval-$length.json" --samples "$OUT/$name-lm-eval-$length-samples.jsonl"
    done
}

for model in drt-x2 drt-x1; do
    [ -f "models/ruler-$model/config.json" ] || { echo "models/ruler-$model is missing: run make ruler first" >&2; exit 1; }
    $F train "configs/lm/ruler/stage1-$model.yaml" --no-progress
    $F train "configs/lm/ruler/composed/$model.yaml" --no-progress
    $F train "configs/lm/ruler/neighbors/$model.yaml" --no-progress
done
measure runs/lm/ruler/neighbors/drt-x2 drt-x2-trained 4096,16384,65536,131072
RUN=runs/lm/ruler/neighbors/drt-x2
[ -f "$OUT/drt-x2-trained-passkey.json" ] || $F eval passkey --model "$RUN" "${READING[@]}" "${PASSKEY_GRID[@]}" \
    --long-trials 2 --out "$OUT/drt-x2-trained-passkey.json"
# the grid of "Training lengths of the single-needle stage" (seed 1), whose depth-0.7 trials at
# 256K all hold their passkey across a chunk boundary
[ -f "$OUT/drt-x2-trained-passkey-seed1.json" ] || $F eval passkey --model "$RUN" "${READING[@]}" \
    --lengths 64k,256k --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --seed 1 --corpus data/lm-byte --dtype bf16 \
    --out "$OUT/drt-x2-trained-passkey-seed1.json"
measure models/ruler-drt-x2 drt-x2-shipped 4096,16384
measure runs/lm/ruler/neighbors/drt-x1 drt-x1-trained 4096,16384
# the same trials at 64K and 256K in fp32: are the digits it misreads bf16's rounding?
[ -f "$OUT/drt-x1-trained-passkey-jitter-fp32-64k-256k.json" ] || $F eval passkey \
    --model runs/lm/ruler/neighbors/drt-x1 "${READING[@]}" --lengths 64k,256k --depths 0.1,0.3,0.5,0.7,0.9 \
    --trials 8 --long-trials 4 --needle-jitter 32 --corpus data/lm-byte --dtype fp32 \
    --out "$OUT/drt-x1-trained-passkey-jitter-fp32-64k-256k.json"
