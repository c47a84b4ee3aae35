"""RULER tasks through the needle evaluation, RULER's string-match score, and the lm-eval export.

`evaluate_ruler` runs each task of `farsight.data.tasks.ruler` over the length x depth grid with
`evaluate_needle_task` (greedy decoding of as many tokens as the reference answer, exact match,
first-token accuracy, DRT's needle retrieval) and adds RULER's score: the fraction of reference
answers contained in the decoded text (`string_match`), per trial, cell and length.

`export_lm_eval` writes the same items (same seeds, same tokenizer) as JSONL plus lm-eval task
YAMLs built on the templates in `farsight/eval/lm_eval_tasks/ruler/`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from farsight.data.tasks.ruler import RulerTask, split_answer
from farsight.eval.choice import write_lm_eval_task
from farsight.eval.needle import check_needle_grid, evaluate_needle_task, format_length, split_cell, trial_rng
from farsight.files import atomic_write, new_folders_for, reported_write, writing_folder

DEPTHLESS = 0.5  # the single depth of the tasks whose answer is spread over the whole context
TEMPLATE = "_farsight_ruler_template.yaml"
UTILS = "utils.py"
TAG = "farsight_ruler"


def string_match(predicted: str, references: Sequence[str]) -> float:
    """RULER's score: the fraction of `references` found in `predicted`, ignoring case.

    The shipped lm-eval utils module (`lm_eval_tasks/ruler/utils.py`) scores the same way."""
    text = predicted.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def task_seed(seed: int, task: str) -> int:
    """The seed of one task's trials: each task draws its own keys and values."""
    return seed * 1_000_003 + zlib.crc32(task.encode())


def task_depths(task: RulerTask, depths: list[float]) -> list[float]:
    """The depths a task runs at: all of them, or DEPTHLESS alone where depth does not apply."""
    return list(depths) if task.uses_depth else [DEPTHLESS]


def add_string_match(summary: dict[str, Any], has_needles: bool = True) -> dict[str, Any]:
    """Add "string_match" to every trial, cell and length of a needle summary (in place).

    Without needles (common and frequent words) every chunk is evidence, so DRT's
    "needle_retrieved" and "evidence_chunks" say nothing and are removed."""
    for trial in summary["trials"]:
        trial["string_match"] = string_match(trial["predicted"], split_answer(trial["answer"]))
        if not has_needles:
            trial.pop("retrieved_needle", None)
            trial.pop("evidence_chunks", None)

    def mean(rows: list[dict[str, Any]]) -> float:
        return sum(r["string_match"] for r in rows) / len(rows)

    for length, row in summary["by_length"].items():
        row["string_match"] = mean([t for t in summary["trials"] if t["length"] == int(length)])
    for cell in summary["by_cell"]:
        cell["string_match"] = mean(
            [t for t in summary["trials"] if (t["length"], t["depth"]) == (cell["length"], cell["depth"])]
        )
    if not has_needles:
        for row in [*summary["by_length"].values(), *summary["by_cell"]]:
            row.pop("needle_retrieved", None)
            row.pop("split_evidence", None)
    return summary


def evaluate_ruler(
    model: Any,
    tasks: list[RulerTask],
    lengths: list[int],
    depths: list[float],
    trials: int | dict[int, int],
    seed: int = 0,
    batch_size: int = 1,
    memory: str = "device",
    kv_dtype: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Every task over the grid; returns {"tasks": {name: needle summary + string match}, "average": {length: score}}.

    The tasks without depth (common and frequent words) run at DEPTHLESS only."""
    check_needle_grid(lengths, depths, trials)
    results = {}
    for task in tasks:
        summary = evaluate_needle_task(
            model,
            task,
            lengths,
            task_depths(task, depths),
            trials,
            seed=task_seed(seed, task.name),
            batch_size=batch_size,
            memory=memory,
            kv_dtype=kv_dtype,
            progress=progress,
        )
        results[task.name] = add_string_match(summary, has_needles=task.uses_depth)
        summary["haystack"] = task.haystack_text
    average = {
        str(length): sum(r["by_length"][str(length)]["string_match"] for r in results.values()) / len(results)
        for length in lengths
    }
    return {"tasks": results, "average": average}


def ruler_table(summary: dict[str, Any]) -> str:
    """One task's results, a row per length: string match first, then the needle metrics (for a
    model with chunks, the needles split over two chunks too)."""
    from farsight.eval.efficiency import format_table

    columns = ["length", "trials", "string match %", "exact match %", "first token %", "needle retrieved %"]
    rows = [
        {
            "length": format_length(int(k)),
            "trials": v["trials"],
            "string match %": 100 * v["string_match"],
            "exact match %": 100 * v["exact_match"],
            "first token %": 100 * v["first_token"],
            "needle retrieved %": 100 * v["needle_retrieved"] if "needle_retrieved" in v else None,
            "split needle: exact": split_cell(v.get("split_evidence")),
            "seconds": v.get("seconds"),
        }
        for k, v in summary["by_length"].items()
    ]
    if any(row["split needle: exact"] is not None for row in rows):
        columns.append("split needle: exact")
    return format_table(rows, [*columns, "seconds"])


def average_table(results: dict[str, Any]) -> str:
    """String match % of every task (rows) at every length (columns), and their average."""
    from farsight.eval.efficiency import format_table

    lengths = list(results["average"])
    names = [format_length(int(n)) for n in lengths]
    rows = [
        {"task": name, **{label: 100 * summary["by_length"][n]["string_match"] for label, n in zip(names, lengths)}}
        for name, summary in results["tasks"].items()
    ]
    rows.append({"task": "average", **{label: 100 * results["average"][n] for label, n in zip(names, lengths)}})
    return format_table(rows, ["task", *names])


def lm_eval_task_name(task: str, length: int) -> str:
    """The lm-eval name of one task at one length, e.g. farsight_ruler_niah_single_1_4k."""
    return f"{TAG}_{task}_{format_length(length).lower()}"


def ruler_items(task: RulerTask, length: int, depths: list[float], trials: int, seed: int = 0) -> list[dict[str, Any]]:
    """The items `evaluate_ruler` would score for one task and length, as text.

    input: the prompt (ending with the answer's lead-in); outputs: the references; answer: the
    reference answer as generated; input_tokens: the input re-tokenized, measured (the noise
    haystack re-tokenizes to exactly the sample's prompt)."""
    trials = check_needle_grid([length], depths, trials)[length]
    depths = task_depths(task, depths)
    tokenizer = task.tokenizer
    items = []
    for di, depth in enumerate(depths):
        for t in range(trials):
            sample = task.sample(length, depth, trial_rng(task_seed(seed, task.name), length, di, t))
            text = tokenizer.decode(sample.prompt.tolist())
            items.append(
                {
                    "index": len(items),
                    "input": text,
                    "outputs": list(sample.info["references"]),
                    "answer": tokenizer.decode(sample.answer.tolist()).strip(),
                    "length": length,
                    "depth": depth,
                    "input_tokens": len(tokenizer.encode(text)),
                    "answer_tokens": sample.answer_length,
                }
            )
    return items


def export_lm_eval(
    tasks: list[RulerTask],
    lengths: list[int],
    depths: list[float],
    trials: int | dict[int, int],
    out: str | Path,
    seed: int = 0,
    overwrite: bool = False,
) -> list[str]:
    """Write the items of every task and length to `out/data/NAME.jsonl`, a task YAML `out/NAME.yaml`
    for each, and the template and utils module they use; returns the task names.

    Every task is tagged "farsight_ruler" and "farsight_ruler_TASK", so lm-eval can run them all
    or one task at every length. A task generates up to twice its longest answer's tokens. `out` is
    locked while it is written and must be new, empty or exported tasks unless `overwrite`
    (`farsight.files.writing_folder`)."""
    per_length = check_needle_grid(lengths, depths, trials)
    out = Path(out)
    with writing_folder(out, "tasks", "an lm-eval task export", overwrite, fix="export to another folder"):
        templates = resources.files("farsight.eval") / "lm_eval_tasks" / "ruler"
        with new_folders_for(out / "x"), reported_write(out):
            out.mkdir(parents=True, exist_ok=True)
            for name in (TEMPLATE, UTILS):
                with resources.as_file(templates / name) as source:
                    text = source.read_text(encoding="utf-8")
                atomic_write(out / name, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
        written = []
        for task in tasks:
            for length in lengths:
                name = lm_eval_task_name(task.name, length)
                items = ruler_items(task, length, depths, per_length[length], seed)
                config = {
                    "include": TEMPLATE,
                    "task": name,
                    "tag": [TAG, f"{TAG}_{task.name}"],
                    "generation_kwargs": {
                        "until": ["\n"],
                        "do_sample": False,
                        "temperature": 0.0,
                        "max_gen_toks": max(8, 2 * max(item["answer_tokens"] for item in items)),
                    },
                }
                write_lm_eval_task(out, name, items, config)
                written.append(name)
    return written
