"""A model card (the README.md of an exported model directory): what the model is, how it was
trained, stage by stage along its train.init_from chain, and the results measured on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farsight.errors import InputError, MissingFileError
from farsight.eval.needle import format_length
from farsight.eval.runs import summarize_run


def training_chain(run: str | Path) -> list[Path]:
    """The runs that made `run`, first stage first: each run's train.init_from, followed back while
    it names a training run (a directory with config.yaml and metrics.jsonl)."""
    from farsight.train.config import load_train_config

    chain: list[Path] = []
    current: Path | None = Path(run)
    while current is not None and (current / "config.yaml").is_file() and (current / "metrics.jsonl").is_file():
        if current.resolve() in [c.resolve() for c in chain]:
            raise InputError(f"the train.init_from chain of {run} loops back to {current}; fix its config.yaml")
        chain.append(current)
        init_from = load_train_config(current / "config.yaml").train.init_from
        current = Path(init_from) if init_from else None
        if current is not None and current.name.startswith("step_") and current.parent.name == "checkpoints":
            current = current.parent.parent  # a checkpoint of a run: the run
    if not chain:
        raise MissingFileError(f"{run} is not a training run (no config.yaml and metrics.jsonl); a model card is written from a run")
    return chain[::-1]


def _count(tokens: int) -> str:
    return f"{tokens / 1e6:.1f}M" if tokens >= 100_000 else f"{tokens:,}"


def _data_description(data: dict[str, Any]) -> str:
    if data.get("kind") == "needle":
        tasks = data.get("mix") or {data.get("task", "passkey"): 1}
        mix = ", ".join(f"{name} {weight}" for name, weight in tasks.items())
        lengths = [length for _, length in data["curriculum"]] if data.get("curriculum") else [data.get("seq_len")]
        return (
            f"needle tasks ({mix}) in haystacks of `{data.get('corpus')}`, lengths {' → '.join(format_length(n) for n in lengths)}, "
            f"answer weight {data.get('answer_weight', 1)}, question alignment {data.get('align', 'the chunk size')}"
        )
    return f"language modelling on `{data.get('path')}`, {format_length(data['seq_len'])}-token windows" if data.get("seq_len") else str(data)


def _needle_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| length | trials | exact match % | 95% interval | needle retrieved % |", "|---|---|---|---|---|"]
    for length, cell in sorted(summary["by_length"].items(), key=lambda item: int(item[0])):
        low, high = cell.get("exact_match_ci95", (None, None))
        interval = f"{100 * low:.0f}-{100 * high:.0f}" if low is not None else "-"
        retrieved = f"{100 * cell['needle_retrieved']:.0f}" if cell.get("needle_retrieved") is not None else "-"
        lines.append(f"| {format_length(int(length))} | {cell['trials']} | {100 * cell['exact_match']:.0f} | {interval} | {retrieved} |")
    return lines


def _ppl_table(entry: dict[str, Any]) -> list[str]:
    lines = ["| length | windows | NLL (nats/token) | ± s.e. |", "|---|---|---|---|"]
    for length, cell in sorted(entry["by_length"].items(), key=lambda item: int(item[0])):
        lines.append(f"| {format_length(int(length))} | {cell['windows']} | {cell['nll']:.4f} | {cell['nll_sem']:.4f} |")
    return lines


def results_section(path: str | Path, chain: list[Path]) -> list[str]:
    """Markdown for one results file: a needle summary (`eval passkey/multikey/niah2hop --out`) or
    the entries of a perplexity file (`eval ppl --out`) that belong to a run of `chain`."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read results file {path} ({exc}); pass a JSON file written by `farsight eval ... --out`") from exc
    if "task" in results and "by_length" in results:
        where = f"{results.get('corpus', '')} {results.get('split', '')}".strip()
        head = f"**{results['task']}** (`{path}`; haystacks: {where or results.get('filler')}, dtype {results.get('dtype')}, question alignment {results.get('align')})"
        return [head, "", *_needle_table(results), ""]
    if "results" in results:
        names = {str(run) for run in chain} | {str(run.resolve()) for run in chain}
        entries = {name: entry for name, entry in results["results"].items() if name in names or str(Path(name).resolve()) in names}
        if not entries:
            raise InputError(f"{path} holds no perplexity of {', '.join(map(str, chain))}; pass a file from `farsight eval ppl --model RUN`")
        lines = []
        for name, entry in entries.items():
            lines += [f"**perplexity of `{name}`** (`{path}`; {results.get('corpus')} {results.get('split')}, dtype {results.get('dtype')})", ""]
            lines += [*_ppl_table(entry), ""]
        return lines
    raise InputError(f"{path} is neither a needle summary nor a perplexity file; pass files written by `farsight eval ... --out`")


def model_card(run: str | Path, name: str, results: list[str | Path] = (), model_path: str | None = None) -> str:
    """The README.md of a model exported from `run` (to `model_path`, by default `name`), with a
    section per results file."""
    from farsight.train.config import load_train_config

    chain = training_chain(run)
    stages = [(stage, summarize_run(stage), load_train_config(stage / "config.yaml")) for stage in chain]
    last = stages[-1][1]
    total = sum(row["tokens"] or 0 for _, row, _ in stages)
    lines = [
        f"# {name}",
        "",
        f"A farsight `{last['model_type']}` model: {last['architecture']}, {last['parameters'] / 1e6:.3f}M parameters, "
        f"trained on {_count(total)} tokens in {len(stages)} stage{'s' if len(stages) > 1 else ''}.",
        "",
        "## Training",
        "",
        "| stage | run | data | steps | tokens | precision | held-out loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, (stage, row, config) in enumerate(stages, 1):
        val = f"{row['val_loss']:.4f}" if row["val_loss"] is not None else "-"
        lines.append(
            f"| {number} | `{stage}` | {_data_description(config.data)} | {row['steps']} | {_count(row['tokens'] or 0)} | {row['precision']} | {val} |"
        )
    lines += ["", "Each stage's full configuration is its run's `config.yaml`. Optimiser of the last stage: "]
    lines[-1] += ", ".join(f"{key} {value}" for key, value in stages[-1][2].optim.to_dict().items()) + "."
    if results:
        lines += ["", "## Results", ""]
        for path in results:
            lines += results_section(path, chain)
    model_path = model_path or name
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        f"farsight generate --model {model_path} --prompt 'def main(' --max-new-tokens 200",
        f"farsight eval passkey --model {model_path} --lengths 1k,16k,1m --depths 0,0.5,1 --trials 4",
        "```",
        "",
        "```python",
        "from farsight.models import load_model",
        f"model = load_model('{model_path}')  # files verified against checksums.json",
        "```",
        "",
    ]
    return "\n".join(lines)
