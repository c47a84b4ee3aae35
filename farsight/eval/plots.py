"""PNG plots of evaluation results (matplotlib, the `plots` extra), written without a display."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farsight.errors import MissingDependencyError
from farsight.eval.needle import format_length


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError("plots need matplotlib: pip install farsight[plots]") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


HEATMAP_METRICS = {"exact_match": "exact match", "first_token": "first token", "string_match": "string match"}


def needle_heatmap(summary: dict[str, Any], path: str | Path, title: str | None = None, metric: str = "exact_match") -> Path:
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curves(
    series: dict[str, dict[int, float]], path: str | Path, ylabel: str, title: str, logx: bool = True
) -> Path:
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
