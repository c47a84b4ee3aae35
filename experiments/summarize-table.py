#!/usr/bin/env python3
"""The summarization stand-in's tables and figure (experiments/summarize.sh) from the models' answers.

    python experiments/summarize-table.py results/summarize drt-x1 baselm-2l drt-x2 baselm
    python experiments/summarize-table.py results/summarize drt-x2 baselm-2l --figure none

Reads OUT/MODEL.json (`farsight eval generate --out`) and each fine-tune's metrics.jsonl
(runs/lm/summarize/MODEL/, else the copy in results/runs/lm/summarize/MODEL/); prints ROUGE-L by
input length (a column per model), the overall scores with the fine-tune's last held-out loss,
and each model against the first (ROUGE-L difference, 95% paired bootstrap over the test
modules); draws ROUGE-L by length into --figure (default docs/figures/summarize-rougeL.png; `none`
draws nothing, for a comparison that should leave the docs' figure as it is).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FIGURE = Path("docs/figures/summarize-rougeL.png")
RESAMPLES = 10_000


def last_validation(model: str) -> dict:
    """The fine-tune's last logged validation record, or {} when neither log exists."""
    for root in ("runs", "results/runs"):
        path = Path(root) / "lm" / "summarize" / model / "metrics.jsonl"
        if path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if "val_loss" in line]
            return records[-1] if records else {}
    return {}


def by_length_table(results: dict[str, dict], base: str) -> list[str]:
    models = list(results)
    lines = ["| input tokens | examples | " + " | ".join(f"{m} ROUGE-L" for m in models) + " |"]
    lines.append("|---" * (len(models) + 2) + "|")
    for row in [b["bucket"] for b in results[base]["by_length"]] + ["all"]:
        cells = [
            r["overall"] if row == "all" else next(b for b in r["by_length"] if b["bucket"] == row)
            for r in results.values()
        ]
        scores = " | ".join(f"{100 * c['rougeL']:.1f}" for c in cells)
        lines.append(f"| {row} | {cells[0]['examples']} | {scores} |")
    return lines


def overall_table(results: dict[str, dict]) -> list[str]:
    lines = ["| model | fine-tune val loss | val answer-token accuracy | ROUGE-1 | ROUGE-2 | ROUGE-L | exact match |"]
    lines.append("|---|---|---|---|---|---|---|")
    for m, r in results.items():
        o, val = r["overall"], last_validation(m)
        loss = f"{val['val_loss']:.3f}" if val else "-"
        accuracy = f"{100 * val['val_answer_token_acc']:.1f}%" if val else "-"
        scores = f"{100 * o['rouge1']:.1f} | {100 * o['rouge2']:.1f} | {100 * o['rougeL']:.1f}"
        lines.append(f"| `{m}` | {loss} | {accuracy} | {scores} | {100 * o['exact_match']:.1f}% |")
    return lines


def paired_differences(results: dict[str, dict], base: str) -> list[str]:
    """ROUGE-L of each model minus the first's over the same test modules, with a 95% interval."""
    rng = np.random.default_rng(0)
    by_where = {m: {a["where"]: a["rougeL"] for a in r["answers"]} for m, r in results.items()}
    wheres = sorted(by_where[base])
    draws = rng.integers(0, len(wheres), size=(RESAMPLES, len(wheres)))
    lines = []
    for m in list(results)[1:]:
        diff = np.array([by_where[m][w] - by_where[base][w] for w in wheres])
        lo, hi = np.percentile(diff[draws].mean(axis=1), [2.5, 97.5])
        lines.append(
            f"{m} - {base} ROUGE-L: {100 * diff.mean():+.2f} (95% paired bootstrap {100 * lo:+.2f} to {100 * hi:+.2f})"
        )
    return lines


def draw_figure(results: dict[str, dict], base: str, figure: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
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
    fig.savefig(figure, dpi=120)


def main(out: str, models: list[str], figure: str) -> None:
    results = {m: json.loads((Path(out) / f"{m}.json").read_text()) for m in models}
    base = models[0]
    print(
        "\n".join(
            [*by_length_table(results, base), "", *overall_table(results), "", *paired_differences(results, base)]
        )
    )
    if figure != "none":
        draw_figure(results, base, Path(figure))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The summarization stand-in's tables and figure.")
    parser.add_argument("out", help="the folder of MODEL.json answers (results/summarize)")
    parser.add_argument("models", nargs="+", help="models, the first the one the others are compared with")
    parser.add_argument("--figure", default=str(FIGURE), help=f"the figure's path, or none (default {FIGURE})")
    args = parser.parse_args()
    missing = [m for m in args.models if not (Path(args.out) / f"{m}.json").is_file()]
    if missing:
        parser.error(
            f"no answers for {', '.join(missing)} in {args.out}: run `farsight eval generate ... --out {args.out}/MODEL.json` first"
        )
    main(args.out, args.models, args.figure)
