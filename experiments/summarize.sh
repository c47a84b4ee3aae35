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
.venv/bin/python - "$OUT" "${MODELS[@]}" <<'PY' | tee "$OUT/rougeL.md"
import json, sys
import numpy as np
out, models = sys.argv[1], sys.argv[2:]
results = {m: json.load(open(f"{out}/{m}.json")) for m in models}
base = models[0]
print("| input tokens | examples | " + " | ".join(f"{m} ROUGE-L" for m in models) + " |")
print("|---" * (len(models) + 2) + "|")
rows = [b["bucket"] for b in results[base]["by_length"]] + ["all"]
for row in rows:
    cells = [r["overall"] if row == "all" else next(b for b in r["by_length"] if b["bucket"] == row) for r in results.values()]
    print(f"| {row} | {cells[0]['examples']} | " + " | ".join(f"{100 * c['rougeL']:.1f}" for c in cells) + " |")
print()
print("| model | fine-tune val loss | val answer-token accuracy | ROUGE-1 | ROUGE-2 | ROUGE-L | exact match |")
print("|---|---|---|---|---|---|---|")
for m, r in results.items():
    o = r["overall"]
    val = {}
    metrics = f"runs/lm/summarize/{m}/metrics.jsonl"
    try:
        val = [json.loads(line) for line in open(metrics) if "val_loss" in line][-1]
    except (OSError, IndexError):
        pass
    loss = f"{val['val_loss']:.3f}" if val else "-"
    acc = f"{100 * val['val_answer_token_acc']:.1f}%" if val else "-"
    print(f"| `{m}` | {loss} | {acc} | {100 * o['rouge1']:.1f} | {100 * o['rouge2']:.1f} | {100 * o['rougeL']:.1f} | {100 * o['exact_match']:.1f}% |")
# paired bootstrap over the test examples: ROUGE-L of each model minus the first's, 95% interval
rng = np.random.default_rng(0)
by_where = {m: {a["where"]: a["rougeL"] for a in r["answers"]} for m, r in results.items()}
wheres = sorted(by_where[base])
draws = rng.integers(0, len(wheres), size=(10000, len(wheres)))
print()
for m in models[1:]:
    diff = np.array([by_where[m][w] - by_where[base][w] for w in wheres])
    lo, hi = np.percentile(diff[draws].mean(axis=1), [2.5, 97.5])
    print(f"{m} - {base} ROUGE-L: {100 * diff.mean():+.2f} (95% paired bootstrap {100 * lo:+.2f} to {100 * hi:+.2f})")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, ax = plt.subplots(figsize=(6, 3.6))
labels = [b["bucket"] for b in results[base]["by_length"]]
for m, r in results.items():
    ax.plot(labels, [100 * b["rougeL"] for b in r["by_length"]], marker="o", label=m)
ax.set_xlabel("input tokens (bytes)")
ax.set_ylabel("ROUGE-L F1")
ax.set_ylim(bottom=0)
ax.set_title("summary line of a Python module, 30 test modules per bucket")
ax.legend()
fig.tight_layout()
fig.savefig("docs/figures/summarize-rougeL.png", dpi=120)
PY
