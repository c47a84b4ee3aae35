"""Needle tasks as lm-eval multiple-choice tasks: the prompt, the true answer and distractors of
the same shape, scored by log-likelihood (`farsight eval passkey --export-choice DIR`).

Each item is the prompt a needle evaluation decodes from (same seed, same grid), so a model's
accuracy here and its exact match there are measured on the same haystacks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from farsight.data.tasks.needles import NeedleTask
from farsight.errors import InputError
from farsight.eval.needle import format_length, trial_rng


def choice_items(
    task: NeedleTask, length: int, depths: list[float], trials: int, choices: int = 4, seed: int = 0
) -> list[dict[str, Any]]:
    """One item per (depth, trial): input (the prompt text, ending before the answer), choices
    (the answer and choices - 1 distinct random digit strings of its length, in random order),
    gold (the answer's place)."""
    if choices < 2:
        raise InputError(f"a multiple-choice task needs at least 2 choices, got {choices}")
    tokenizer = task.tokenizer
    items = []
    for di, depth in enumerate(depths):
        for t in range(trials):
            sample = task.sample(length, depth, trial_rng(seed, length, di, t))
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
) -> list[str]:
    """Write out/data/NAME.jsonl and out/NAME.yaml per length (NAME = farsight_TASK_mc_LENGTH,
    tagged farsight_TASK_mc); returns the task names."""
    out = Path(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    tag = f"farsight_{task.name}_mc"
    names = []
    for length in lengths:
        name = f"{tag}_{format_length(length).lower()}"
        items = choice_items(task, length, depths, trials[length], choices, seed)
        data = (out / "data" / f"{name}.jsonl").resolve()
        data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        config = {
            "task": name,
            "tag": [tag],
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "input",
            "doc_to_choice": "choices",
            "doc_to_target": "gold",
            "target_delimiter": " ",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
        (out / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        names.append(name)
    return names
