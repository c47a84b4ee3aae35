#!/usr/bin/env bash
# R4 ablations of the retriever (SPEC 2.3) on R1's passkey task: no Gumbel noise, random
# retrieval, plain softmax instead of softmax off by one; each trained with the demo DRT's recipe
# and compared with it (docs/results.md). Needs R1's DRT: `make r1`.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r4
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
for ablation in nogumbel random nosoftmax1; do
    $F train "configs/r4-drt-$ablation.yaml" --no-progress
done
# 3 depths x 4 trials = 12 per length up to 64K, 3 x 2 = 6 at 256K and 1M
GRID=(--lengths 1k,4k,16k,64k,256k,1m --depths 0,0.5,1 --trials 4 --long-trials 2 --batch-size 2 --corpus data/stdlib-byte --split val)
for ablation in nogumbel random nosoftmax1; do
    $F eval passkey --model "runs/r4-drt-$ablation" "${GRID[@]}" --out "$OUT/$ablation.json"
done
$F eval compare results/r1/drt-g1.json "$OUT"/nogumbel.json "$OUT"/random.json "$OUT"/nosoftmax1.json \
    --labels "DRT (R1),no Gumbel,random retriever,plain softmax" --plot "$FIG/r4-ablations.png" \
    --title "R4: retriever ablations, passkey exact match"
$F eval compare results/r1/drt-g1.json "$OUT"/nogumbel.json "$OUT"/random.json "$OUT"/nosoftmax1.json \
    --labels "DRT (R1),no Gumbel,random retriever,plain softmax" --metric needle_retrieved
