"""A model card (the README.md of an exported model directory): what the model is, how it was
trained, stage by stage along its train.init_from chain, and the results measured on it."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farsight.data.batches import describe_data
from farsight.data.corpora import jsonl_lines
from farsight.errors import InputError, MissingFileError
from farsight.eval.efficiency import format_table
from farsight.eval.needle import format_length, results_table
from farsight.eval.perplexity import format_error
from farsight.eval.runs import architecture, training_record
from farsight.models.io import trained_weights
from farsight.readers import parse_json_object
from farsight.train.checkpoint import checkpoint_step, list_checkpoints
from farsight.train.metrics import read_metrics


@dataclass
class Stage:
    """One training run of a model's history, up to the step whose weights went on."""

    run: Path
    until: int | None  # the checkpoint step the next stage (or the export) took; None: the newest
    config: Any  # farsight.train.config.TrainConfig
    record: dict[str, Any]  # farsight.eval.runs.training_record up to `until`


def _as_run(path: Path) -> tuple[Path, int | None] | None:
    """(run directory, checkpoint step or None) for a run or one of its checkpoints, else None."""
    step = checkpoint_step(path)
    run = path.parent.parent if step is not None else path
    if (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file():
        return run, step
    return None


def _training_directory(run: Path, out_dir: str) -> Path:
    """The directory training ran from, which a relative train.init_from is relative to: the run's
    path less its relative train.out_dir, or the current directory."""
    out = Path(out_dir)
    parts = run.resolve().parts
    if not out.is_absolute() and parts[-len(out.parts) :] == out.parts:
        return Path(*parts[: -len(out.parts)])
    return Path.cwd()


def training_chain(source: str | Path) -> tuple[list[Stage], str | None]:
    """The runs that made the model of `source` (a run or a checkpoint of one), first stage first,
    following train.init_from back while it names a run; and the init_from where that stops (a
    model directory, or a path that is not here), None if the first stage started from scratch."""
    from farsight.train.config import load_train_config

    found = _as_run(Path(source))
    if found is None:
        raise MissingFileError(
            f"{source} is not a training run or a checkpoint of one (no config.yaml and metrics.jsonl); a model card is written from the run"
        )
    stages: list[Stage] = []
    origin = None
    while found is not None:
        run, step = found
        if any(run.resolve() == stage.run.resolve() for stage in stages):
            raise InputError(
                f"the train.init_from chain of {source} comes back to {run}; fix the init_from in its config.yaml"
            )
        if step is None:
            checkpoints = list_checkpoints(run / "checkpoints")
            step = checkpoints[-1][0] if checkpoints else None
        config = load_train_config(run / "config.yaml")
        stages.append(Stage(run, step, config, training_record(read_metrics(run / "metrics.jsonl"), until=step)))
        origin = config.train.init_from
        if origin is None:
            break
        path = Path(origin)
        found = _as_run(path if path.is_absolute() else _training_directory(run, config.train.out_dir) / path)
    return stages[::-1], (origin if found is None else None)


def _read_results(path: Path) -> dict[str, Any]:
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"cannot read results file {path} ({exc}); pass a JSON file written by `farsight eval ... --out`"
        ) from exc
    if not isinstance(results, dict):
        raise InputError(
            f"{path} holds a JSON {type(results).__name__}, not the object `farsight eval ... --out` writes"
        )
    return results


def _is_needle_summary(results: dict[str, Any]) -> bool:
    cells = results.get("by_length")
    return isinstance(cells, dict) and all(
        isinstance(c, dict) and {"trials", "exact_match", "first_token"} <= c.keys() for c in cells.values()
    )


def _is_ppl_entry(entry: Any) -> bool:
    cells = entry.get("by_length") if isinstance(entry, dict) else None
    return isinstance(cells, dict) and all(
        isinstance(c, dict) and {"nll", "nll_sem", "windows"} <= c.keys() for c in cells.values()
    )


def _is_lm_eval(results: dict[str, Any]) -> bool:
    """An lm-eval results file, as `farsight eval harness --out` writes it."""
    return "lm_eval_version" in results and isinstance(results.get("results"), dict)


@dataclass
class ModelNames:
    """How a card calls each model its results may have been measured on (this export, each
    stage's run and the checkpoint it went on from), found by path or by the SHA-256 of the
    trained weights (`farsight.models.io.trained_weights`), which every copy of them shares."""

    by_path: dict[Path, str]
    by_weights: dict[str, str]

    def label(self, model: str | None, weights: str | None) -> str | None:
        """The name of the model a results file measured (`model` as it recorded the path,
        `weights` the trained weights it recorded), None if it is none of these. A file that
        records the weights is matched by them alone, since a run's path names other weights once
        it trains on; an older one by its path, or by the weights that path holds now."""
        if weights is not None:
            return self.by_weights.get(weights)
        if model is None:
            return None
        name = self.by_path.get(Path(model).resolve())
        if name is None:
            held = trained_weights(model)
            name = self.by_weights.get(held) if held is not None else None
        return name

    def listed(self) -> str:
        return " or ".join(sorted(set(self.by_path.values())))


def _check_measured_on(path: Path, results: dict[str, Any], names: ModelNames) -> None:
    """Refuse a results file whose recorded model is none of `names` (one that records no model,
    from an older farsight, is taken as it is)."""
    model, weights = results.get("model"), results.get("trained_weights")
    if (model is not None or weights is not None) and names.label(model, weights) is None:
        raise InputError(
            f"{path} was measured on {model or f'weights {weights[:12]}'}, not on this model or a copy of its weights; pass results of {names.listed()} "
            "or of another export of the same checkpoint"
        )


def lm_eval_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """A row per task and metric of an lm-eval results file: the score, its standard error where
    lm-eval gives one, and the items scored. RULER's tasks name their metric by length and score
    the lengths an item was not built for as -1; those are left out."""
    rows = []
    for task, metrics in sorted(results["results"].items()):
        items = (results.get("n-samples", {}).get(task) or {}).get("effective", "-")
        for key, value in metrics.items():
            metric, comma, filter_name = key.partition(",")  # lm-eval names a score "metric,filter"
            if not comma or not isinstance(value, (int, float)) or metric.endswith("_stderr") or value == -1:
                continue
            error = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "score": f"{value:.3f}",
                    "± s.e.": f"{error:.3f}" if isinstance(error, (int, float)) else "-",
                    "items": str(items),
                }
            )
    return rows


# items of each task an answers file shows in a card, and the characters of each answer
CARD_ANSWERS_PER_TASK = 2
CARD_ANSWER_CHARS = 80


def answers_section(path: Path, names: ModelNames) -> list[str]:
    """Markdown for an answers file (`farsight eval harness --samples`, JSON lines) of one of
    `names`: the first items of each task with their target, the model's answer (cut to
    CARD_ANSWER_CHARS characters) and their scores."""
    try:
        lines = list(jsonl_lines(path, InputError))
    except OSError as exc:
        raise InputError(
            f"cannot read answers file {path} ({exc}); pass a file written by `farsight eval harness --samples`"
        ) from exc
    records, checked = [], set()
    for number, line in lines:
        fix = "pass a file written by `farsight eval harness --samples`"
        record = parse_json_object(line, f"{path}:{number}", fix)
        if not {"task", "target", "answer", "scores"} <= record.keys():
            raise InputError(f"{path}:{number}: not an item's record (task, target, answer, scores); {fix}")
        measured = (record.get("model"), record.get("trained_weights"))
        if measured not in checked:
            _check_measured_on(path, record, names)
            checked.add(measured)
        records.append(record)
    shown: Counter[str] = Counter()
    rows = []
    for record in records:
        if shown[record["task"]] == CARD_ANSWERS_PER_TASK:
            continue
        shown[record["task"]] += 1
        answer = str(record["answer"])
        cut = answer[:CARD_ANSWER_CHARS] + ("…" if len(answer) > CARD_ANSWER_CHARS else "")
        rows.append(
            {
                "task": record["task"],
                "length": str(record.get("length") or "-"),
                "target": json.dumps(record["target"]),
                "answer": "`" + json.dumps(cut, ensure_ascii=False)[1:-1].replace("`", "'").replace("|", "\\|") + "`",
                # RULER scores the lengths an item was not built for as -1
                "scores": ", ".join(f"{k} {v}" for k, v in record["scores"].items() if v != -1),
            }
        )
    head = (
        f"**answers** (`{path.name}`): the first {CARD_ANSWERS_PER_TASK} items of each task, as the model wrote them."
    )
    return [head, "", format_table(rows, ["task", "length", "target", "answer", "scores"], markdown=True), ""]


def _retrieval_note(results: dict[str, Any]) -> str:
    """How the model read, where the results were measured otherwise than its config says: the
    chunks per query chunk (`--retrieval-top-k`) and the neighbors read beside each
    (`--retrieval-neighbors`); else nothing."""
    note = ""
    top_k = results.get("retrieval_top_k")
    if top_k:
        note += f", reading the {top_k} best past chunks per chunk (`--retrieval-top-k {top_k}`)"
    neighbors = results.get("retrieval_neighbors")
    if neighbors is not None:
        before, after = neighbors
        note += (
            f", each with the {before} chunk(s) before and {after} after it (`--retrieval-neighbors {before}:{after}`)"
        )
    return note


def results_section(path: str | Path, names: ModelNames) -> list[str]:
    """Markdown for a results file: a needle summary (`farsight eval passkey ... --out`) or an
    lm-eval results file (`farsight eval harness ... --out`) measured on one of `names` (resolved
    path -> how the card calls it), the rows of a perplexity file (`farsight eval ppl ...
    --out`) that belong to them, or the first answers of an answers file (`farsight eval harness
    --samples`, .jsonl)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return answers_section(path, names)
    results = _read_results(path)
    if _is_lm_eval(results):
        _check_measured_on(path, results, names)
        head = (
            f"**lm-eval {results['lm_eval_version']}** (`{path.name}`): run through `farsight eval harness`"
            + (f" in {results['dtype']}" if results.get("dtype") else "")
            + _retrieval_note(results)
            + "; RULER's metric is the item's length in tokens."
        )
        return [
            head,
            "",
            format_table(lm_eval_rows(results), ["task", "metric", "score", "± s.e.", "items"], markdown=True),
            "",
        ]
    if _is_needle_summary(results):
        _check_measured_on(path, results, names)
        haystack = (
            f"text of {results.get('corpus')} ({results.get('split')} split)"
            if results.get("filler", "corpus") == "corpus"
            else "repeated filler text"
        )
        # files from before question_offsets was recorded were all measured with the prompt padded to a chunk boundary
        offsets = results.get("question_offsets", "chunk boundary")
        where = {
            "chunk boundary": "question padded to end on a chunk boundary",
            "no chunks": "question wherever the sample puts it (the model has no chunks)",
        }.get(offsets, f"question at {offsets}")
        depths = sorted({cell["depth"] for cell in results.get("by_cell", []) if "depth" in cell})
        at = f", needle at depth {', '.join(f'{d:g}' for d in depths)}" if depths else ""
        head = (
            f"**{results.get('task', 'needle task')}** (`{path.name}`): haystacks of {haystack}{at}, {where}, "
            f"run in {results.get('dtype')}{_retrieval_note(results)}."
        )
        return [head, "", results_table(results, markdown=True), ""]
    if isinstance(results.get("results"), dict) and all(_is_ppl_entry(e) for e in results["results"].values()):
        lines = []
        for model, entry in results["results"].items():
            name = names.label(model, entry.get("trained_weights"))
            if name is None:
                continue
            rows = [
                {
                    "length": format_length(int(n)),
                    "windows": c["windows"],
                    "NLL (nats/token)": f"{c['nll']:.4f}",
                    "± s.e.": format_error(c["nll_sem"]),
                }
                for n, c in sorted(entry["by_length"].items(), key=lambda item: int(item[0]))
            ]
            lines += [
                f"**perplexity of {name}** (`{path.name}`): {results.get('corpus')} ({results.get('split')} split), run in {results.get('dtype')}.",
                "",
            ]
            lines += [format_table(rows, ["length", "windows", "NLL (nats/token)", "± s.e."], markdown=True), ""]
        if not lines:
            raise InputError(
                f"{path} holds no perplexity of this model or its earlier stages; pass a file from `farsight eval ppl --model RUN --out`"
            )
        return lines
    raise InputError(
        f"{path} is neither a needle summary, an lm-eval results file nor a perplexity file; pass files written by "
        "`farsight eval passkey|multikey|niah2hop|ppl|harness ... --out`"
    )


def samples_section(source: str | Path, model: Any, name: str, prompts: list[str]) -> list[str]:
    """Markdown: what `model` writes after each prompt (tokenizer from `source`), with the
    `farsight generate` command (its defaults) that prints the same text from `name` when `model`
    is that export as `load_model` reads it (fp32, eval mode)."""
    import re
    import shlex

    from farsight.data.tokenizers import load_tokenizer
    from farsight.models import resolve_model_dir
    from farsight.models.generation import continue_text

    tokenizer = load_tokenizer(resolve_model_dir(str(source)))
    lines = [
        "## Samples",
        "",
        "Sampled with `farsight generate`'s defaults (200 new tokens, temperature 0.8, seed 0); each command prints the same text.",
        "",
    ]
    for prompt in prompts:
        text = prompt + continue_text(model, tokenizer, prompt)
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
        lines += [
            "```bash",
            f"farsight generate --model {name} --prompt {shlex.quote(prompt)}",
            "```",
            "",
            fence + "text",
            text,
            fence,
            "",
        ]
    return lines


def training_time(stage: Stage) -> str:
    """A stage's time in its training loop (the logged intervals: compilation, evaluation and
    checkpoints included, loading left out) and where it ran: the devices its metrics logged, else
    its config's train.device unless "auto"."""
    hours = stage.record["train_hours"]
    device = stage.record["device"] or (stage.config.train.device if stage.config.train.device != "auto" else None)
    if hours is None:
        time = "-"
    elif hours >= 1:
        time = f"{hours:.1f} h"
    else:
        minutes, seconds = divmod(round(hours * 3600), 60)
        time = f"{minutes} min {seconds} s"
    return time if device is None else f"{time} on {device}"


def model_card(
    source: str | Path,
    name: str,
    results: list[str | Path] = (),
    samples: list[str] = (),
    weights_dtype: str | None = None,
    exported_to: Path | None = None,
) -> Callable[[Any], str]:
    """The README.md of a model exported as `name` from `source` (a run or one of its checkpoints),
    with a section per results file and what it writes after each prompt of `samples`, as a
    function of the exported model (as `farsight generate` loads it: `export_model` passes it so).
    The training chain and the results files are read here, so bad input fails before an export
    starts."""
    stages, origin = training_chain(source)
    total = sum(stage.record["tokens"] or 0 for stage in stages)
    # results may name the exported directory, the run, the checkpoint or an earlier stage's run, or
    # record the trained weights of one of them (measured on another export of them)
    names = ModelNames({} if exported_to is None else {exported_to.resolve(): "this model"}, {})
    for number, stage in enumerate(stages, 1):
        label = (
            "this model" if number == len(stages) else f"stage {number} (`{stage.run.name}`, before the later stages)"
        )
        names.by_path[stage.run.resolve()] = label
        checkpoint = stage.run if stage.until is None else stage.run / "checkpoints" / f"step_{stage.until:08d}"
        names.by_path[checkpoint.resolve()] = label
        weights = trained_weights(checkpoint)
        if weights is not None:
            names.by_weights[weights] = label
    training = ["## Training", ""]
    if origin is not None:
        training += [f"Stage 1 started from the weights of `{origin}`, whose training is not described here.", ""]
    training += [
        "| stage | run | data | steps | tokens | precision | training time | held-out loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for number, stage in enumerate(stages, 1):
        record = stage.record
        val = f"{record['val_loss']:.4f} (step {record['val_step']})" if record["val_loss"] is not None else "-"
        training.append(
            f"| {number} | `{stage.run.name}` | {describe_data(stage.config.data, record['steps'])} | {record['steps']} "
            f"| {(record['tokens'] or 0) / 1e6:.2f}M | {record['precision'] or '-'} | {training_time(stage)} | {val} |"
        )
    optim = stages[-1].config.optim.to_dict()
    training += [
        "",
        "Each stage's full configuration is its run's `config.yaml`. The last stage's optimiser: AdamW, "
        + ", ".join(f"{k} {v}" for k, v in optim.items())
        + ".",
    ]
    repeated = next(
        (path for i, path in enumerate(results) if Path(path).resolve() in {Path(r).resolve() for r in results[:i]}),
        None,
    )
    if repeated is not None:
        raise InputError(f"--results names {repeated} twice; name each results file once")
    results_lines = ["", "## Results", ""] if results else []
    for path in results:
        results_lines += results_section(path, names)
    use = [
        "",
        "## Use",
        "",
        "From the directory that holds this one:",
        "",
        "```bash",
        f"farsight generate --model {name} --prompt 'def main(' --max-new-tokens 200",
        f"farsight eval passkey --model {name} --lengths 1k,4k --depths 0,0.5,1 --trials 4",
        "```",
        "",
        "```python",
        "from farsight.models import load_model",
        "",
        f'model = load_model("{name}")  # the files are checked against checksums.json',  # as ruff formats it
        "```",
        "",
    ]

    def write(model: Any) -> str:
        head = [
            f"# {name}",
            "",
            f"A farsight `{model.model_type}` model: {architecture(model.config)}, {model.num_parameters() / 1e6:.3f}M parameters, "
            f"trained on {total / 1e6:.1f}M tokens in {len(stages)} stage{'s' if len(stages) > 1 else ''}"
            + (f", weights stored in {weights_dtype}" if weights_dtype else "")
            + ".",
            "",
        ]
        sample_lines = [""] + samples_section(source, model, name, list(samples)) if samples else []
        return "\n".join(head + training + results_lines + sample_lines + use)

    return write
