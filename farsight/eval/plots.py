"""PNG plots of evaluation results (matplotlib, the `plots` extra), written without a display."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farsight.errors import InputError, MissingDependencyError
from farsight.eval.needle import format_length
from farsight.files import atomic_write, new_folders_for, reported_write


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError("plots need matplotlib: pip install farsight[plots]") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    try:  # atomically: an interrupted or failed write leaves an earlier image as it was
        with new_folders_for(path), reported_write(path):
            atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or "png"))
    finally:
        plt.close(fig)
    return path


HEATMAP_METRICS = {"exact_match": "exact match", "first_token": "first token", "string_match": "string match"}


def needle_heatmap(
    summary: dict[str, Any], path: str | Path, title: str | None = None, metric: str = "exact_match"
) -> Path:
    """A needle metric (exact match by default; RULER scores string match) in % as a depth
    (rows) x context length (columns) heatmap."""
    label = HEATMAP_METRICS[metric]
    plt = _pyplot()
    lengths = sorted({c["length"] for c in summary["by_cell"]})
    depths = sorted({c["depth"] for c in summary["by_cell"]})
    grid = [[float("nan")] * len(lengths) for _ in depths]
    for cell in summary["by_cell"]:
        grid[depths.index(cell["depth"])][lengths.index(cell["length"])] = 100 * cell[metric]
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.55 * len(depths) + 1.8))
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{label} %")
    ax.set_title(title or f"{summary['task']}: {label}")
    return _save(plt, fig, path)


def curves(series: dict[str, dict[int, float]], path: str | Path, ylabel: str, title: str, logx: bool = True) -> Path:
    """One line per model: value vs context length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    xs = sorted({x for points in series.values() for x in points})
    ax.set_xticks(xs, [format_length(x) for x in xs], rotation=45)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def loss_curve_points(records: list[dict[str, Any]], smooth: int = 10) -> dict[str, list[float]]:
    """From a run's metrics.jsonl records: tokens seen (millions) and the train loss as a moving
    average over `smooth` records, and the held-out losses at the tokens seen by their steps
    (interpolated between logged steps: tokens per step vary with a curriculum or a resume)."""
    import numpy as np

    train = [r for r in records if "loss" in r and r.get("tokens")]
    losses = [r["loss"] for r in train]
    recent = [losses[max(0, i - smooth + 1) : i + 1] for i in range(len(losses))]
    val = [r for r in records if "val_loss" in r]
    steps = [0] + [r["step"] for r in train]
    tokens = [0] + [r["tokens"] for r in train]
    # past the last logged step, go on at the last interval's tokens per step
    rate = (tokens[-1] - tokens[-2]) / max(steps[-1] - steps[-2], 1) if train else 0.0
    val_tokens = (
        [float(np.interp(r["step"], steps, tokens)) + rate * max(r["step"] - steps[-1], 0) for r in val]
        if train
        else []
    )
    return {
        "train_x": [r["tokens"] / 1e6 for r in train],
        "train_y": [sum(window) / len(window) for window in recent],
        "val_x": [t / 1e6 for t in val_tokens],
        "val_y": [r["val_loss"] for r in val] if train else [],
    }


def held_out_gaps(
    runs: list[tuple[str, list[dict[str, Any]]]], reference: str, smooth: int = 10
) -> list[tuple[str, list[float], list[float]]]:
    """Each run's held-out loss minus that of its reference run, at the run's own tokens seen:
    (label, tokens in millions, gap) for every run not labelled `reference`. With one reference
    run every run is compared with it; with several (seeds), the i-th run of each label is compared
    with the i-th reference run, which saw the same data and the same held-out batches (a seed's
    batches move its loss by more than the models differ). The reference curve is interpolated
    between its evaluations; evaluations past its last one are left out, not extrapolated."""
    return _paired_gaps([(label, loss_curve_points(records, smooth)) for label, records in runs], reference)


def _paired_gaps(
    points: list[tuple[str, dict[str, list[float]]]], reference: str
) -> list[tuple[str, list[float], list[float]]]:
    """held_out_gaps on runs already reduced to loss_curve_points, (label, points) each."""
    import numpy as np

    base = [p for label, p in points if label == reference]
    labels = list(dict.fromkeys(label for label, _ in points))
    if not base:
        raise InputError(f"--relative-to {reference!r} names no run; use one of the labels {labels}")
    counts = {label: sum(1 for other, _ in points if other == label) for label in labels}
    unpaired = [label for label in labels if len(base) > 1 and counts[label] != len(base)]
    if unpaired:
        raise InputError(
            f"{reference!r} has {len(base)} runs but {unpaired[0]!r} has {counts[unpaired[0]]}; give each label as many runs "
            f"(seeds in the same order) or a single {reference!r} run"
        )
    gaps, seen = [], dict.fromkeys(labels, 0)
    for label, p in points:
        index, seen[label] = seen[label], seen[label] + 1
        if label == reference:
            continue
        ref = base[index if len(base) > 1 else 0]
        if not ref["val_x"]:
            raise InputError(f"the {reference!r} run it is compared with has no held-out losses in its metrics.jsonl")
        kept = [(x, y) for x, y in zip(p["val_x"], p["val_y"]) if ref["val_x"][0] <= x <= ref["val_x"][-1]]
        gaps.append(
            (label, [x for x, _ in kept], [y - float(np.interp(x, ref["val_x"], ref["val_y"])) for x, y in kept])
        )
    return gaps


def loss_curves(
    runs: list[tuple[str, list[dict[str, Any]]]],
    path: str | Path,
    title: str,
    smooth: int = 10,
    relative_to: str | None = None,
) -> Path:
    """Training curves of runs, (label, metrics.jsonl records) each: the train loss faint, the
    held-out loss with markers, vs tokens seen. Runs that share a label (the seeds of one model)
    share a colour and one legend entry. With `relative_to` (a label), a second panel shows each
    other run's held-out loss minus its reference run's (held_out_gaps: seeds paired in order),
    faint per run and bold as the label's mean, zoomed to the last three quarters of training:
    gaps of a hundredth of a nat vanish beside a loss that falls from 5 to 1."""
    plt = _pyplot()
    points = [(label, loss_curve_points(records, smooth)) for label, records in runs]
    gaps = _paired_gaps(points, relative_to) if relative_to is not None else None
    if gaps is None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    else:
        fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(7, 6.8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colours: dict[str, str] = {}
    for label, run in points:
        first = label not in colours
        colour = colours.setdefault(label, f"C{len(colours) % 10}")
        ax.plot(run["train_x"], run["train_y"], color=colour, alpha=0.35, linewidth=1)
        ax.plot(run["val_x"], run["val_y"], color=colour, marker="o", markersize=3, label=label if first else None)
    ax.set_ylabel("loss: held-out (markers), train (faint)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if gaps is None:
        ax.set_xlabel("tokens seen (millions)")
        return _save(plt, fig, path)
    import numpy as np

    gap_ax.axhline(0.0, color=colours[relative_to], linewidth=1.5)
    late = []
    for label in dict.fromkeys(label for label, _, _ in gaps):
        mine = [(xs, ys) for other, xs, ys in gaps if other == label and xs]
        for xs, ys in mine:
            gap_ax.plot(xs, ys, color=colours[label], alpha=0.35, linewidth=1)
            late += [y for x, y in zip(xs, ys) if x >= 0.25 * xs[-1]]
        if mine:  # the mean over the label's runs, at the first run's evaluations
            grid = mine[0][0]
            mean = np.mean([np.interp(grid, xs, ys) for xs, ys in mine], axis=0)
            gap_ax.plot(grid, mean, color=colours[label], marker="o", markersize=3, linewidth=2)
    if late:
        low, high = min(late + [0.0]), max(late + [0.0])
        pad = 0.15 * (high - low) or 0.01
        gap_ax.set_ylim(low - pad, high + pad)
    gap_ax.set_xlabel("tokens seen (millions)")
    gap_ax.set_ylabel(f"held-out loss minus {relative_to}\n(nats/token; bold: mean over runs)")
    gap_ax.grid(alpha=0.3)
    return _save(plt, fig, path)
