"""Needle tasks as lm-eval multiple-choice tasks: the prompt, the true answer and distractors of
the same shape, scored by log-likelihood (`farsight eval passkey --export-choice DIR`).

Each item is the prompt a needle evaluation decodes from (same seed, same grid), so a model's
accuracy here and its exact match there are measured on the same haystacks.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from farsight.data.tasks.needles import NeedleTask
from farsight.errors import InputError
from farsight.eval.needle import format_length, needle_rng, needle_shift, trial_rng
from farsight.files import atomic_write, new_folders_for, reported_write, writing_folder

DATA_LOADER = "farsight_data.py"  # copied into an export: loads its items relative to the folder


def write_lm_eval_task(out: Path, name: str, items: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """out/data/NAME.jsonl (the items) and out/NAME.yaml (`config`, reading them through
    out/farsight_data.py with a path relative to `out`, so the folder can move), each file
    written atomically; a full disk is one line (`farsight.files.write_failure`)."""
    with new_folders_for(out / "data" / "x"), reported_write(out):
        (out / "data").mkdir(parents=True, exist_ok=True)
        with resources.as_file(resources.files("farsight.eval") / "lm_eval_tasks" / DATA_LOADER) as source:
            text = source.read_text(encoding="utf-8")
        atomic_write(out / DATA_LOADER, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        lines = "".join(json.dumps(item) + "\n" for item in items)
        atomic_write(out / "data" / f"{name}.jsonl", lambda tmp: Path(tmp).write_text(lines, encoding="utf-8"))
        config = {**config, "dataset_kwargs": {"data_files": {"test": f"data/{name}.jsonl"}}}
        # the loader's tag cannot come out of safe_dump: it is the one line added by hand
        task = yaml.safe_dump(config, sort_keys=False) + f"custom_dataset: !function {Path(DATA_LOADER).stem}.load\n"
        atomic_write(out / f"{name}.yaml", lambda tmp: Path(tmp).write_text(task, encoding="utf-8"))


def choice_items(
    task: NeedleTask,
    length: int,
    depths: list[float],
    trials: int,
    choices: int = 4,
    seed: int = 0,
    needle_jitter: int = 0,
) -> list[dict[str, Any]]:
    """One item per (depth, trial): input (the prompt text, ending before the answer), choices
    (the answer and choices - 1 distinct random digit strings of its length, in random order),
    gold (the answer's place). `needle_jitter` shifts each needle as `evaluate_needle_task` does."""
    if choices < 2:
        raise InputError(f"a multiple-choice task needs at least 2 choices, got {choices}")
    tokenizer = task.tokenizer
    items = []
    for di, depth in enumerate(depths):
        for t in range(trials):
            shift = needle_shift(needle_jitter, depth, needle_rng(seed, length, di, t))
            sample = task.sample(length, depth, trial_rng(seed, length, di, t), needle_shift=shift)
            answer = tokenizer.decode(sample.answer.tolist()).strip()
            if not answer.isdigit():
                raise InputError(
                    f"the {task.name} task's answers are not digit strings ({answer!r}); export passkey or multikey"
                )
            rng = np.random.default_rng([seed, length, di, t, choices])
            options = {answer}
            if 10 ** len(answer) < choices:
                raise InputError(
                    f"{len(answer)}-digit answers allow fewer than {choices} distinct choices; use fewer --choices"
                )
            while len(options) < choices:
                options.add("".join(str(int(d)) for d in rng.integers(0, 10, size=len(answer))))
            ordered = sorted(options - {answer})
            gold = int(rng.integers(0, choices))
            ordered.insert(gold, answer)
            items.append(
                {
                    "input": tokenizer.decode(sample.prompt.tolist()),
                    "choices": ordered,
                    "gold": gold,
                    "length": length,
                    "depth": depth,
                }
            )
    return items


def export_choice_tasks(
    task: NeedleTask,
    lengths: list[int],
    depths: list[float],
    trials: dict[int, int],
    out: str | Path,
    choices: int = 4,
    seed: int = 0,
    overwrite: bool = False,
    needle_jitter: int = 0,
) -> list[str]:
    """Write out/data/NAME.jsonl and out/NAME.yaml per length (NAME = farsight_TASK_mc_LENGTH,
    tagged farsight_TASK_mc) and the loader they share (`write_lm_eval_task`); returns the task names.
    `out` is locked while it is written and must be new, empty or exported tasks unless `overwrite`
    (`farsight.files.writing_folder`)."""
    out = Path(out)
    with writing_folder(out, "tasks", "an lm-eval task export", overwrite, fix="export to another folder"):
        tag = f"farsight_{task.name}_mc"
        names = []
        for length in lengths:
            name = f"{tag}_{format_length(length).lower()}"
            items = choice_items(task, length, depths, trials[length], choices, seed, needle_jitter)
            config = {
                "task": name,
                "tag": [tag],
                "dataset_path": "json",
                "test_split": "test",
                "output_type": "multiple_choice",
                "doc_to_text": "input",
                "doc_to_choice": "choices",
                "doc_to_target": "gold",
                "target_delimiter": " ",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                "metadata": {"version": 1.0},
            }
            write_lm_eval_task(out, name, items, config)
            names.append(name)
    return names
