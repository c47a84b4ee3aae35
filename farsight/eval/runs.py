"""What training runs are, side by side: parameters, tokens, steps, losses and speed, read from each
run's newest checkpoint and its metrics.jsonl (the model table of a comparison)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farsight.errors import MissingFileError
from farsight.train.checkpoint import checkpoint_step
from farsight.train.metrics import read_metrics


def architecture(config: Any) -> str:
    """A short description of a model config, e.g. 'drt-x2, window 64, top-4, 4 layers' (the model
    names of configs/README.md); a DRT
    that departs from the paper's retriever (docs/design.md §2.3: the R4 ablations) says how."""
    if hasattr(config, "groups"):
        text = f"drt-x{config.groups}, window {config.window}, top-{config.top_k}"
        if config.retriever == "none":
            text += ", no retrieval"
        elif config.retriever == "random":
            text += ", random retriever"  # Gumbel noise does not apply to random picks
        elif not config.gumbel:
            text += ", no Gumbel"
        if not config.softmax_one:
            text += ", plain softmax"
    else:
        text = config.attention + (f" {config.window}" if config.window else "")
        text += f", {config.position}" if config.position else ""
    return f"{text}, {config.n_layers} layers"


def training_record(records: list[dict[str, Any]], until: int | None = None) -> dict[str, Any]:
    """Steps, tokens, last train and held-out loss, precision, device, hours and tokens/s from a run's
    metrics.jsonl records up to step `until` (all without it). Time and speed come from the logged
    intervals, so a run resumed across sessions counts only its training."""
    kept = [r for r in records if until is None or r.get("step", 0) <= until]
    train = [r for r in kept if "loss" in r]
    val = [r for r in kept if "val_loss" in r]
    row: dict[str, Any] = {
        "steps": train[-1]["step"] if train else 0,
        "tokens": train[-1].get("tokens") if train else 0,
        "train_loss": train[-1]["loss"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None,
        "val_step": val[-1]["step"] if val else None,
        "precision": train[-1].get("precision") if train else None,
        # every device the run trained on, in order (a run resumed elsewhere has several); None when not logged
        "device": ", ".join(dict.fromkeys(r["device"] for r in train if r.get("device"))) or None,
    }
    # tokens_per_s is the speed over the interval since the previous record of the same session
    seconds, previous = 0.0, 0
    for r in train:
        done = r.get("tokens", 0) - previous
        if r.get("tokens_per_s") and done > 0:
            seconds += done / r["tokens_per_s"]
        previous = r.get("tokens", previous)
    row["train_hours"] = seconds / 3600 if seconds else None
    row["tokens_per_s"] = row["tokens"] / seconds if seconds else None
    return row


def summarize_run(run: str | Path) -> dict[str, Any]:
    """One row: the model of the run's newest checkpoint and its training record up to that
    checkpoint (records a crash left after it are not counted)."""
    from farsight.models import load_model, resolve_model_dir

    run = Path(run)
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.exists():
        raise MissingFileError(f"{metrics_path} does not exist; pass a training run directory (train.out_dir)")
    directory = resolve_model_dir(run)
    model = load_model(directory)
    row = {
        "run": str(run),
        "model_type": model.model_type,
        "architecture": architecture(model.config),
        "parameters": model.num_parameters(),
        "checkpoint": directory.name,
    }
    return row | training_record(read_metrics(metrics_path), until=checkpoint_step(directory))


def runs_table(rows: list[dict[str, Any]]) -> str:
    from farsight.eval.efficiency import format_table

    cells = [
        {
            "run": r["run"],
            "model": r["architecture"],
            "params (M)": f"{r['parameters'] / 1e6:.3f}",
            "steps": r["steps"],
            "tokens (M)": f"{r['tokens'] / 1e6:.1f}" if r["tokens"] else None,
            "train loss": r["train_loss"],
            "val loss": r["val_loss"],
            "tokens/s": f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else None,
            "hours": f"{r['train_hours']:.2f}" if r["train_hours"] else None,
        }
        for r in rows
    ]
    return format_table(
        cells, ["run", "model", "params (M)", "steps", "tokens (M)", "train loss", "val loss", "tokens/s", "hours"]
    )
