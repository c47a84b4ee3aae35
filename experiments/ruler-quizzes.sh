#!/usr/bin/env bash
# Quizzes in RULER's needle haystack (docs/results.md, "Quizzes in the needle haystack"): the
# shipped models/ruler-drt-x2 trained further on needle haystacks that ask and answer questions
# about their own distractors (the niah option quizzes, docs/ruler.md): 1,200 steps at 1K -> 4K
# tokens (configs/lm/ruler/quizzes/drt-x2.yaml), then 2,000 more with more quizzes, by the
# language-modelling loss alone (drt-x2-more.yaml) or with every quiz a target of supervised
# retrieval (drt-x2-supervised.yaml). Then the supervised recipe straight from the shipped model
# for 4,000 steps (drt-x2-supervised-long.yaml), that run continued for 2,000 steps at 8K -> 16K
# tokens (drt-x2-supervised-16k.yaml) and that one for 800 steps at 32K -> 64K
# (drt-x2-supervised-64k.yaml). The start and each run answer farsight's niah_multikey_2 and
# niah_single_1 in RULER's wording (never trained) at 1K, 4K and 16K tokens, and lm-eval's own
# niah_multikey_2 and niah_single_1 at 4K (50 items), the last three runs also at 16K, 64K and
# 128K, reading 2 chunks as make ruler's models do (experiments/ruler-measure.sh). Finished
# runs and result files are reused. Run from the repository root after make ruler.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/ruler-quizzes
source experiments/ruler-measure.sh

measure models/ruler-drt-x2 shipped
for name in drt-x2 drt-x2-more drt-x2-supervised; do
    $F train "configs/lm/ruler/quizzes/$name.yaml" --no-progress
    measure "runs/lm/ruler/quizzes/$name" "$name"
done
for name in drt-x2-supervised-long drt-x2-supervised-16k drt-x2-supervised-64k; do
    $F train "configs/lm/ruler/quizzes/$name.yaml" --no-progress
    measure "runs/lm/ruler/quizzes/$name" "$name" 16384 65536 131072
done
# the last run on make ruler's passkey grid, 1K to 1M tokens
passkey_grid runs/lm/ruler/quizzes/drt-x2-supervised-64k drt-x2-supervised-64k
