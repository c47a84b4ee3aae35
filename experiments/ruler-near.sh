#!/usr/bin/env bash
# Copying inside the window after the RULER mix (docs/results.md, "Copying inside the window after
# the RULER mix"): from the passkey stages of `make ruler`, the RULER mix alone
# (configs/lm/ruler/<model>.yaml, into results/ruler-varied/) and with a fifth or a twentieth of the
# needles right before their question (configs/lm/ruler/near/: drt-x2, baselm-2l and their -share05
# twins), and for drt-x2 both with another seed (drt-x2-seed1: the mix alone, drt-x2-seed1-near: a
# fifth near), a fifth near trained three times as long with both seeds (drt-x2-long,
# drt-x2-long-seed1), and a fifth near in the composed NIAH wording with three seeds
# (drt-x2-composed, drt-x2-composed-seed1, drt-x2-composed-seed2); each run then takes R1's in-span
# passkey check (the passkey about 45 tokens before the answer, inside every window) and lm-eval's
# niah_single_1 at 4K and 16K; baselm-2l's passkey stage takes the in-span check too. The drt-x2
# runs of the mix alone and with a fifth near also answer niah_single_1 at 64K and 128K and the
# passkey from 1K to 1M; the composed run with seed 2 is then read with fewer chunks per chunk than
# it was trained with. Finished runs and result files are reused. Run from the repository root.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-near
mkdir -p "$OUT"
bash experiments/lm-data.sh
INSPAN=(--lengths 1k,4k --depths 1 --trials 50 --corpus data/lm-byte --align 1 --dtype bf16 --batch-size 2)

inspan() {  # RUN PREFIX: R1's in-span passkey check into PREFIX-inspan-passkey.json
    [ -f "$2-inspan-passkey.json" ] || $F eval passkey --model "$1" "${INSPAN[@]}" --out "$2-inspan-passkey.json"
}
single_needle() {  # RUN PREFIX LENGTH...: lm-eval's niah_single_1, 50 items a length, into PREFIX-lm-eval-LENGTH.json
    local run=$1 prefix=$2 length
    shift 2
    for length in "$@"; do
        [ -f "$prefix-lm-eval-$length.json" ] || $F eval harness --model "$run" --tasks niah_single_1 \
            --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 --dtype bf16 \
            --out "$prefix-lm-eval-$length.json" --samples "$prefix-lm-eval-$length-samples.jsonl"
    done
}
long_passkey() {  # RUN PREFIX: the passkey from 1K to 1M tokens into PREFIX-passkey.json
    [ -f "$2-passkey.json" ] || $F eval passkey --model "$1" --lengths 1k,4k,16k,64k,256k,1m \
        --depths 0.1,0.5,0.9 --trials 4 --long-trials 1 --corpus data/lm-byte --dtype bf16 --out "$2-passkey.json"
}

# the passkey stages every run here starts from (make ruler's first stage), and the RULER mix alone
# from them (configs/lm/ruler/<model>.yaml, farsight's varied wording, no needle near its question):
# the rows the others are read against, in results/ruler-varied/
VARIED=results/ruler-varied
mkdir -p "$VARIED"
for model in drt-x2 baselm-2l; do
    $F train "configs/lm/ruler/stage1-$model.yaml" --no-progress
    $F train "configs/lm/ruler/$model.yaml" --no-progress
    inspan "runs/lm/ruler/$model" "$VARIED/$model"
done
single_needle runs/lm/ruler/drt-x2 "$VARIED/drt-x2" 4096 16384 65536 131072
single_needle runs/lm/ruler/baselm-2l "$VARIED/baselm-2l" 4096 16384
long_passkey runs/lm/ruler/drt-x2 "$VARIED/drt-x2"
for model in drt-x2 baselm-2l drt-x2-share05 baselm-2l-share05 drt-x2-seed1 drt-x2-seed1-near drt-x2-long \
    drt-x2-long-seed1 drt-x2-composed drt-x2-composed-seed1 drt-x2-composed-seed2; do
    $F train "configs/lm/ruler/near/$model.yaml" --no-progress
    inspan "runs/lm/ruler/near/$model" "$OUT/$model"
    single_needle "runs/lm/ruler/near/$model" "$OUT/$model" 4096 16384
done
inspan runs/lm/ruler/stage1-baselm-2l "$OUT/stage1-baselm-2l"
for model in drt-x2 drt-x2-seed1-near drt-x2-long drt-x2-long-seed1 drt-x2-composed drt-x2-composed-seed1 \
    drt-x2-composed-seed2; do
    single_needle "runs/lm/ruler/near/$model" "$OUT/$model" 65536 131072
    long_passkey "runs/lm/ruler/near/$model" "$OUT/$model"
done
# The composed run with seed 2 read with its 1, 2 or 4 (its own top_k) best past chunks per chunk
# (--retrieval-top-k), and the same recipe reading 2 while it learns the mix (from the same passkey
# stage), read as trained: the passkey from 64K to 1M with 12 trials a length, and lm-eval's
# niah_single_1 from 4K to 128K; fp32, the fast mode of a CPU without bf16 instructions.
measure_top_k() {  # RUN PREFIX [--retrieval-top-k K]
    local run=$1 prefix=$2
    shift 2
    [ -f "$prefix-passkey.json" ] || $F eval passkey --model "$run" "$@" --lengths 64k,256k,1m \
        --depths 0.1,0.5,0.9 --trials 4 --long-trials 4 --corpus data/lm-byte --dtype fp32 --out "$prefix-passkey.json"
    for length in 4096 16384 65536 131072; do
        [ -f "$prefix-lm-eval-$length.json" ] || $F eval harness --model "$run" "$@" --tasks niah_single_1 \
            --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 --dtype fp32 \
            --out "$prefix-lm-eval-$length.json" --samples "$prefix-lm-eval-$length-samples.jsonl"
    done
}
for k in 1 2 4; do
    measure_top_k runs/lm/ruler/near/drt-x2-composed-seed2 "$OUT/drt-x2-composed-seed2-top$k" --retrieval-top-k $k
done
$F train configs/lm/ruler/near/drt-x2-composed-seed2-train-top2.yaml --no-progress
measure_top_k runs/lm/ruler/near/drt-x2-composed-seed2-train-top2 "$OUT/drt-x2-composed-seed2-train-top2"
