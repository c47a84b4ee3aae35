#!/usr/bin/env bash
# R5 castle vs castle-swl vs causal (standard causal attention) at parameter parity (7 standard
# heads, 4 CASTLE heads; configs/castle/), same data, 8.19M tokens and three seeds each: held-out
# loss mean and spread, and the loss curves (docs/results.md). Seeds outermost, so a partial run
# compares like with like. Seed N of configs/castle/<kind>.yaml is runs/castle/<kind>-sN.
set -euo pipefail
F=.venv/bin/farsight
OUT=results/r5
mkdir -p "$OUT"
MODELS=()
for seed in 0 1 2; do
    for kind in causal castle castle-swl; do
        $F train "configs/castle/$kind.yaml" --no-progress --set train.seed=$seed --set "train.out_dir=runs/castle/$kind-s$seed"
        MODELS+=(--model "runs/castle/$kind-s$seed")
    done
done
# every model scores the same 1024 held-out windows of its training length
$F eval ppl "${MODELS[@]}" --corpus data/stdlib-byte --split val --lengths 256 --windows 1024 --batch-size 16 --out "$OUT/loss.json"
# the table and loss curves read each run's newest checkpoint: the runs trained above
RUNS=(runs/castle/causal-s{0,1,2} runs/castle/castle-s{0,1,2} runs/castle/castle-swl-s{0,1,2})
$F eval runs "${RUNS[@]}" --out "$OUT/runs.json" --plot docs/figures/r5-loss-curves.png \
    --labels causal,causal,causal,castle,castle,castle,castle-swl,castle-swl,castle-swl \
    --title "R5: 0.38M parameters, 8.19M tokens, 3 seeds" --relative-to causal
.venv/bin/python - "$OUT/loss.json" <<'PY'
import json, statistics, sys
results = json.load(open(sys.argv[1]))["results"]
groups = {}
for path, out in results.items():
    kind = path.rsplit("/", 1)[-1].rsplit("-s", 1)[0]
    groups.setdefault(kind, []).append(out["by_length"]["256"]["nll"])
print("attention    seeds  held-out loss (nats/token)  spread (std)  min     max     minus causal, same seed (mean ± std)")
for kind, losses in groups.items():
    gaps = [x - c for x, c in zip(losses, groups["causal"])]
    print(
        f"{kind:11s}  {len(losses):5d}  {statistics.mean(losses):26.4f}  {statistics.stdev(losses):12.4f}  {min(losses):.4f}  {max(losses):.4f}"
        f"  {statistics.mean(gaps):+.4f} ± {statistics.stdev(gaps):.4f}"
    )
PY
