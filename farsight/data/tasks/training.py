"""`data.kind: needle` — training batches of needle tasks with a length curriculum.

Each sample is a task instance (passkey, multikey, niah2hop, a RULER-style task of
`farsight.data.tasks.ruler` such as niah_multikey_2 or vt, or a weighted mix of them) of the
current curriculum length, haystack filler from the corpus's train split (the validation batches
use the validation split), answer tokens weighted `answer_weight` in the loss, and optionally a
share of plain corpus windows for language modelling. Batches hold about `batch_tokens` tokens,
so short curriculum stages use more samples per step. A RULER-style task reads the haystack
RULER gives it (noise sentences, real text from `corpus`, or distractor needles), whatever
`filler` says; `filler` sets the passkey tasks' haystack and the language-modelling rows' text.
The needle asked about sits at a uniform depth, or, in a `near_question` share of the task
rows, right before the question (depth 1): in reach of a sliding window, so that a windowed
baseline trained on a mix whose answers mostly lie beyond its span still learns to copy the
ones it can see. With `retrieval_weight` > 0 each batch also holds `retrieval_targets` (the
evidence's tokens and the answer's, `NeedleSample.retrieval_targets`): a causal-retrieval model
then adds its supervised retrieval loss, weighted so, to the language-modelling loss
(docs/design.md §2.7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from farsight.config import ConfigBase, require
from farsight.data.batch_source import batch_rng
from farsight.data.tasks.filler import Filler, make_filler
from farsight.data.tasks.needles import TASKS, NeedleTask, make_task
from farsight.data.tasks.ruler import RULER_TASKS, make_ruler_tasks


def known_tasks() -> list[str]:
    """Every task name `data.task` and `data.mix` take: the passkey tasks, then the RULER-style ones."""
    return [*TASKS, *RULER_TASKS]


@dataclass
class NeedleBatchConfig(ConfigBase):
    task: str = "passkey"
    mix: dict[str, float] | None = None
    corpus: str = ""
    filler: str = "corpus"
    seq_len: int = 1024
    batch_tokens: int = 16384
    curriculum: list[list[int]] | None = None
    answer_weight: float = 10.0
    needle_weight: float = 1.0
    lm_fraction: float = 0.0
    near_question: float = 0.0
    retrieval_weight: float = 0.0
    align: int | None = None
    task_options: dict[str, Any] = field(default_factory=dict)

    def task_names(self) -> list[str]:
        """The tasks this run trains: those of `mix`, else `task`."""
        return list(self.mix) if self.mix else [self.task]

    def validate(self) -> None:
        if self.mix is not None:
            require(
                isinstance(self.mix, dict) and bool(self.mix),
                f"data.mix must map each task to its weight (e.g. {{passkey: 1, vt: 1}}), got {self.mix!r}; "
                "remove it to train data.task",
            )
        names = self.task_names()
        for name in names:
            require(name in known_tasks(), f"data.task {name!r} is unknown; choose from {', '.join(known_tasks())}")
        if self.mix is not None:
            require(
                all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in self.mix.values()),
                f"data.mix weights must be numbers > 0, got {self.mix!r}",
            )
        require(self.filler in ("corpus", "repeat"), f"data.filler must be 'corpus' or 'repeat', got {self.filler!r}")
        require(
            self.filler == "repeat" or bool(self.corpus),
            "data.corpus (a prepared dataset) is required for filler: corpus",
        )
        real_text = [n for n in names if n in RULER_TASKS and RULER_TASKS[n].text == "corpus"]
        require(
            not real_text or bool(self.corpus),
            f"{', '.join(real_text)} read{'s' if len(real_text) == 1 else ''} real text (RULER's essays): set data.corpus to a prepared dataset",
        )
        require(self.seq_len >= 16, f"data.seq_len must be >= 16, got {self.seq_len}")
        require(self.batch_tokens >= self.seq_len, "data.batch_tokens must be >= data.seq_len")
        require(self.answer_weight > 0, f"data.answer_weight must be > 0, got {self.answer_weight}")
        require(self.needle_weight >= 0, f"data.needle_weight must be >= 0, got {self.needle_weight}")
        require(0 <= self.lm_fraction < 1, f"data.lm_fraction must be in [0, 1), got {self.lm_fraction}")
        require(0 <= self.near_question <= 1, f"data.near_question must be in [0, 1], got {self.near_question}")
        require(self.retrieval_weight >= 0, f"data.retrieval_weight must be >= 0, got {self.retrieval_weight}")
        if self.curriculum is not None:
            shape = "data.curriculum must be a list of [step, length] pairs of integers starting at step 0, e.g. [[0, 256], [500, 1024]]"
            pairs = self.curriculum if isinstance(self.curriculum, list) else None
            require(
                bool(pairs) and all(isinstance(p, list) and len(p) == 2 and all(_is_int(x) for x in p) for p in pairs),
                f"{shape}; got {self.curriculum!r}",
            )
            steps = [s for s, _ in self.curriculum]
            require(steps == sorted(steps) and steps[0] == 0, f"{shape} and increasing steps; got {self.curriculum!r}")
            require(
                all(16 <= n <= self.seq_len for _, n in self.curriculum),
                "data.curriculum lengths must be in [16, seq_len]",
            )
        require(
            isinstance(self.task_options, dict) and all(isinstance(o, dict) for o in self.task_options.values()),
            f"data.task_options must map a task name to its options, e.g. {{passkey: {{digits: 7}}}}; got {self.task_options!r}",
        )
        stray = sorted(set(self.task_options) - set(names))
        require(
            not stray,
            f"data.task_options names {', '.join(map(repr, stray))}, which this run does not train; it trains {', '.join(names)}",
        )

    def describe(self, steps: int | None = None) -> str:
        """One line for a model card: tasks, haystacks and the lengths reached in `steps` steps."""
        tasks = ", ".join(f"{name} {weight:g}" for name, weight in self.mix.items()) if self.mix else self.task
        options = "; ".join(
            f"{name} " + ", ".join(f"{k}={v}" for k, v in opts.items()) for name, opts in self.task_options.items()
        )
        haystack = f"text of `{self.corpus}`" if self.filler == "corpus" else "repeated filler text"
        if any(name in RULER_TASKS for name in self.task_names()):
            haystack += " (RULER-style tasks: RULER's haystack for each)"
        reached = (
            [int(n) for start, n in self.curriculum if steps is None or int(start) < steps]
            if self.curriculum
            else [self.seq_len]
        )
        text = f"needle tasks ({tasks}{'; ' + options if options else ''}) in haystacks of {haystack}, "
        text += (
            f"lengths {' → '.join(f'{n:,}' for n in reached)} tokens, answer tokens weighted {self.answer_weight:g}x"
        )
        text += f", needles and questions weighted {self.needle_weight:g}x" if self.needle_weight != 1 else ""
        text += f", {self.lm_fraction:.0%} plain-text rows" if self.lm_fraction else ""
        text += f", {self.near_question:.0%} of the needles right before the question" if self.near_question else ""
        text += f", supervised retrieval weighted {self.retrieval_weight:g}" if self.retrieval_weight else ""
        where = {None: "at chunk boundaries", 1: "at any offset"}.get(
            self.align, f"at multiples of {self.align} tokens"
        )
        return text + f", question {where}"

    def length_at(self, step: int) -> int:
        if not self.curriculum:
            return self.seq_len
        current = self.seq_len
        for start, length in self.curriculum:
            if step >= start:
                current = int(length)
        return current


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class NeedleBatches:
    def __init__(self, config: NeedleBatchConfig, seed: int, model: dict[str, Any] | None = None) -> None:
        from farsight.data.tokenizers import load_tokenizer

        self.config = config
        self.seed = seed
        self.retrieval_weight = config.retrieval_weight
        if config.corpus:
            from farsight.data.token_files import load_token_dataset

            self.tokenizer = load_token_dataset(config.corpus, "train").tokenizer
        else:
            self.tokenizer = load_tokenizer("byte")
        chunk = (model or {}).get("chunk_size", 1)
        # checked here, not only by the model's config: the model is built after its data (it needs the tokenizer)
        require(_is_int(chunk) and chunk >= 1, f"model.chunk_size must be an integer >= 1, got {chunk!r}")
        self.chunk_size = chunk
        align = config.align or chunk
        # questions at multiples of `align` inside a chunk: each sample draws its offset, else every
        # sample of one length would end its question at the same offset and the model would learn
        # retrieval for that offset only (drt-x2 did)
        self.offsets = chunk // align if align < chunk else 1
        names = config.task_names()
        weights = np.asarray([config.mix[n] for n in names] if config.mix else [1.0])
        self.weights = weights / weights.sum()
        self.tasks = {}
        self.text = {}  # the filler of the passkey tasks and of the language-modelling rows
        for split in ("train", "val"):
            self.text[split] = make_filler(config.filler, self.tokenizer, config.corpus, split)
            # one filler per haystack and split, shared by every task that reads it
            fillers = {"corpus" if config.filler == "corpus" else "noise": self.text[split]}
            self.tasks[split] = [self._task(n, align, split, fillers) for n in names]

    def _task(self, name: str, align: int, split: str, fillers: dict[str, Filler]) -> NeedleTask:
        options = self.config.task_options.get(name, {})
        if name in TASKS:
            return make_task(name, self.tokenizer, self.text[split], align, **options)
        (task,) = make_ruler_tasks(
            [name], self.tokenizer, align, corpus=self.config.corpus, split=split, options=options, fillers=fillers
        )
        return task

    def digests(self) -> dict[str, str]:
        """What the batches are drawn from beyond the config: the corpus's token files, if any."""
        from farsight.data.token_files import dataset_digest

        return {"data.corpus": dataset_digest(self.config.corpus)} if self.config.corpus else {}

    def _batch(self, split: str, length: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        n = max(1, self.config.batch_tokens // length)
        ids = np.empty((n, length), dtype=np.int64)
        weights = np.ones((n, length), dtype=np.float32)
        # 0 for the plain-text rows: nothing to find
        targets = np.zeros((n, length), dtype=np.int16) if self.config.retrieval_weight else None
        tasks = self.tasks[split]
        for i in range(n):
            if rng.random() < self.config.lm_fraction:
                ids[i] = self.text[split].take(length, rng)
                continue
            task = tasks[int(rng.choice(len(tasks), p=self.weights))]
            shift = self.config.align * int(rng.integers(0, self.offsets)) if self.offsets > 1 else 0
            sample = task.sample(length, self._depth(rng), rng, shift)
            ids[i] = sample.input_ids
            weights[i] = sample.loss_weights(self.config.answer_weight, self.config.needle_weight, self.chunk_size)
            if targets is not None:
                targets[i] = sample.retrieval_targets(self.chunk_size)
        ids_t = torch.from_numpy(ids)
        batch = {"input_ids": ids_t, "labels": ids_t, "loss_weights": torch.from_numpy(weights)}
        if targets is not None:
            batch["retrieval_targets"] = torch.from_numpy(targets)
        return batch

    def _depth(self, rng: np.random.Generator) -> float:
        """Where a row's needle goes: uniform in [0, 1], or 1 (right before the question) in a
        `near_question` share of the rows. No extra draw without that share, so that the
        batches of a config that leaves it out stay what they were."""
        if self.config.near_question and rng.random() < self.config.near_question:
            return 1.0
        return float(rng.random())

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return self._batch("train", self.config.length_at(step), batch_rng(self.seed, 0, step, micro, rank))

    def eval_batch(self, index: int) -> dict[str, torch.Tensor]:
        return self._batch("val", self.config.seq_len, batch_rng(self.seed, 1, index))
