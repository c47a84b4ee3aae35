#!/usr/bin/env bash
# R3 (language-model protocol): language-model pre-training on long documents and perplexity vs
# length. drt-x1, drt-x2, baselm (window 64 + ALiBi), baselm-2l (BaseLM + 2 layers) and causal (full
# causal attention, RoPE), each pre-trained at 4K tokens on the same 52M byte tokens in the same
# order (configs/lm/pretrain/; corpus: experiments/lm-data.sh), then scored on the same held-out
# 128K-token windows from 4K (1x) to 128K (32x). The held-out split has only two documents of 128K
# tokens, so those windows run across document boundaries; a second table scores 8 whole documents
# to 64K (16x). causal is scored on the same windows in a run of its own beside drt-x1 (its cost
# grows as L^2, about 44 min). Run from the repository root: `make r3`. A run that is interrupted
# resumes where it stopped; a finished run is reused.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r3
FIG=docs/figures
mkdir -p "$OUT" "$FIG"
bash experiments/lm-data.sh
for model in drt-x1 drt-x2 baselm baselm-2l causal; do
    $F train "configs/lm/pretrain/$model.yaml" --no-progress
done
R=runs/lm/pretrain
PPL=(--corpus data/lm-byte --split val --windows 12 --window-length 128k --batch-size 1 --dtype bf16)
$F eval ppl --model $R/drt-x1 --model $R/drt-x2 --model $R/baselm --model $R/baselm-2l \
    --lengths 4k,8k,16k,32k,64k,128k "${PPL[@]}" --out "$OUT/lm-ppl.json" --plot "$FIG/r3-lm-ppl.png"
$F eval ppl --model $R/drt-x1 --model $R/drt-x2 --model $R/baselm --model $R/baselm-2l \
    --lengths 4k,8k,16k,32k,64k "${PPL[@]}" --windows 8 --window-length 64k --out "$OUT/lm-ppl-documents.json" \
    --plot "$FIG/r3-lm-ppl-documents.png"
$F eval ppl --model $R/drt-x1 --model $R/causal --lengths 4k,8k,16k,32k,64k,128k "${PPL[@]}" --out "$OUT/lm-ppl-causal.json"
# the runs' table and loss curves read each run's newest checkpoint, so they name runs/ (trained
# above), not the copies of config.yaml and metrics.jsonl kept in results/runs/
$F eval runs $R/drt-x1 $R/drt-x2 $R/baselm $R/baselm-2l $R/causal --out "$OUT/lm-models.json" \
    --labels "drt-x1,drt-x2,baselm,baselm-2l,causal" --plot "$FIG/r3-lm-loss.png" \
    --title "pre-training: 52M byte tokens, 4K windows, same order"
