"""Needle-in-a-haystack evaluation: exact match of every answer token by greedy decoding, plus
first-token accuracy (what the DRT authors' code scores), over a length x depth grid."""

from __future__ import annotations

import math
import numbers
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from farsight.data.tasks.needles import NeedleTask
from farsight.errors import InputError
from farsight.eval.decoding import greedy_continuation
from farsight.progress import progress_bar


@dataclass
class TrialResult:
    length: int
    depth: float
    trial: int
    exact: bool
    first_token: bool
    retrieved_needle: bool | None
    answer: str
    predicted: str
    evidence_chunks: int | None = None  # how many chunks hold the evidence (a model with retrieval)


def score_answer(predicted: np.ndarray, answer: np.ndarray, lead: int = 0) -> tuple[bool, bool]:
    """(exact match of all answer tokens, first token correct). The first token is answer[lead]:
    `lead` blank tokens (a byte-level " " before the passkey) would make it trivially right."""
    predicted, answer = np.asarray(predicted), np.asarray(answer)
    exact = bool(len(predicted) == len(answer) and (predicted == answer).all())
    return exact, bool(len(predicted) > lead and predicted[lead] == answer[lead])


def parse_length(text: str) -> int:
    """'1k' -> 1024, '16M' -> 16 * 2**20, '1500' -> 1500."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise InputError(f"cannot read length {text!r}; use numbers like 1024, 16k or 1m") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise InputError(f"length {text!r} must be a positive whole number of tokens")
    return int(value)


def format_length(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


LONG = 1 << 16  # lengths above 64K count as long contexts: fewer trials by default


def trials_per_length(lengths: list[int], trials: int, long_trials: int | None = None) -> dict[int, int]:
    """`trials` per (length, depth) cell, or `long_trials` for lengths above 64K when given."""
    for name, value in (("trials", trials), ("long trials", long_trials)):
        if value is not None and value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    return {n: trials if long_trials is None or n <= LONG else long_trials for n in lengths}


def check_needle_grid(
    lengths: list[int],
    depths: list[float],
    trials: int | dict[int, int],
    names: tuple[str, str, str] = ("lengths", "depths", "trials"),
) -> dict[int, int]:
    """The trials per length of the grid lengths x depths, once it has a cell, every length is a
    positive integer, every depth lies in [0, 1] and every length has at least one trial
    (InputError otherwise). `names` name the three in the messages (the command's flags)."""
    lengths_name, depths_name, trials_name = names
    if not lengths:
        raise InputError(f"{lengths_name} is empty; pass at least one length in tokens, e.g. [4096]")
    if not depths:
        raise InputError(f"{depths_name} is empty; pass at least one depth in [0, 1], e.g. [0.5]")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
            raise InputError(f"{lengths_name} holds {length!r}; a length is a whole number of tokens >= 1")
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, numbers.Real) or not 0.0 <= depth <= 1.0:
            raise InputError(
                f"{depths_name} {depth!r} is outside [0, 1]; a depth is the needle's position as a fraction of the haystack"
            )
    per_length = trials if isinstance(trials, dict) else {length: trials for length in lengths}
    for length in lengths:
        count = per_length.get(length)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise InputError(f"{trials_name} must be a whole number >= 1, got {count!r} for length {length}")
    return per_length


def trial_rng(seed: int, length: int, depth_index: int, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, length, depth_index, trial])


def offset_rng(seed: int, length: int, depth_index: int, trial: int) -> np.random.Generator:
    """The generator of a trial's question offset: apart from trial_rng, so that an unaligned
    trial has the aligned trial's needles."""
    return np.random.default_rng([seed, length, depth_index, trial, 1])


def needle_rng(seed: int, length: int, depth_index: int, trial: int) -> np.random.Generator:
    """The generator of a trial's needle shift (`needle_jitter`): apart from trial_rng, so that a
    shifted trial has the unshifted trial's haystack, needles and question."""
    return np.random.default_rng([seed, length, depth_index, trial, 2])


def needle_shift(jitter: int, depth: float, rng: np.random.Generator) -> int:
    """A trial's shift of its asked needle under `needle_jitter`: `jitter` consecutive values,
    so the needle takes any of `jitter` offsets, later than its depth in the haystack's first half
    and earlier in its second (0 to jitter - 1 or 1 - jitter to 0); 0 without jitter."""
    if jitter <= 1:
        return 0
    k = int(rng.integers(jitter))
    return k if depth <= 0.5 else k - (jitter - 1)


def question_offsets(model: Any, task: NeedleTask) -> int:
    """How many offsets within a chunk a question may end at: 1 (a chunk boundary, where the
    session pads the prompt to) unless the task's `align` is below the model's chunk size."""
    chunk = getattr(model.config, "chunk_size", None)
    if chunk is None or task.align >= chunk:
        return 1
    if chunk % task.align:
        raise InputError(
            f"align {task.align} does not divide the model's chunk size {chunk}; pass a divisor of {chunk}, e.g. 1"
        )
    return chunk // task.align


def question_offsets_label(model: Any, task: NeedleTask, offsets: int | None = None) -> str:
    """Where the grid's questions end, as results files record it: "chunk boundary" (padded),
    "any multiple of A within a chunk" (unpadded) or "no chunks". `offsets` is
    question_offsets(model, task) where the caller has it already."""
    if (question_offsets(model, task) if offsets is None else offsets) > 1:
        return f"any multiple of {task.align} within a chunk"
    return "chunk boundary" if getattr(model.config, "chunk_size", None) else "no chunks"


def evaluate_needle_task(
    model: Any,
    task: NeedleTask,
    lengths: list[int],
    depths: list[float],
    trials: int | dict[int, int],
    seed: int = 0,
    batch_size: int = 1,
    memory: str = "device",
    kv_dtype: str | None = None,
    progress: bool = True,
    needle_jitter: int = 0,
) -> dict[str, Any]:
    """Run the grid; returns {"trials": [...], "by_length": {...}, "by_cell": {...}, timing}.

    Trials of one (length, depth) cell are batched `batch_size` at a time (they have equal
    prompt lengths when the answer length is fixed, else they run one by one). `trials` may map
    each length to its own number of trials (long contexts cost more). For DRT,
    `retrieved_needle` says whether the answer chunk's retrieval held every chunk of the evidence
    (the passkey digits; both links of a 2-hop chain).

    Question offsets: with the task's `align` at the model's chunk size (or a model without
    chunks) the session pads each prompt so that its question ends on a chunk boundary, the
    paper's setup. With `align` below the chunk size the prompt is fed as it is, and each trial's
    question ends at a random multiple of `align` within its chunk (with the needles of the
    aligned grid), so the grid tests that answers do not depend on where the landmarks fall.

    Needle offsets: the depth alone places the asked needle, so every trial of a cell holds it at
    the same offset within a chunk, and one cell may test only needles that straddle a chunk
    boundary (a DRT must then retrieve both chunks) or only needles that do not. `needle_jitter`
    J > 1 moves each trial's needle by its own shift (`needle_shift`, J consecutive offsets, with
    the haystack, needles and question of the unshifted trial), so that with J = the chunk size a
    cell's trials sample every offset.
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    if needle_jitter < 0:
        raise InputError(f"needle_jitter must be >= 0, got {needle_jitter}")
    per_length = check_needle_grid(lengths, depths, trials)
    decode_tokens = model.config.vocab_size
    results: list[TrialResult] = []
    # progress counts prompt tokens: a 1M-token trial moves the bar while it streams
    total = sum(length * per_length[length] for length in lengths) * len(depths)
    bar = progress_bar(
        total=total, disable=not progress, unit="tok", unit_scale=True, dynamic_ncols=True, desc=task.name
    )
    device = next(model.parameters()).device
    offsets = question_offsets(model, task)
    seconds: dict[int, float] = defaultdict(float)
    for length in lengths:
        for di, depth in enumerate(depths):
            bar.set_postfix(length=format_length(length), depth=depth)
            samples = [
                task.sample(
                    length,
                    depth,
                    trial_rng(seed, length, di, t),
                    task.align * int(offset_rng(seed, length, di, t).integers(offsets)),
                    needle_shift(needle_jitter, depth, needle_rng(seed, length, di, t)),
                )
                for t in range(per_length[length])
            ]
            groups: dict[tuple[int, int], list[int]] = defaultdict(list)
            for i, s in enumerate(samples):
                groups[(len(s.question), len(s.prompt), s.answer_length)].append(i)
            for (_, _, answer_len), members in groups.items():
                for start in range(0, len(members), batch_size):
                    batch = members[start : start + batch_size]
                    prompt = torch.from_numpy(np.stack([samples[i].prompt for i in batch])).to(device)
                    if int(prompt.max()) >= decode_tokens:
                        raise InputError("the task's tokenizer does not match the model's vocabulary")
                    # the question is what gets aligned (landmark before " is", as in the paper)
                    question = len(samples[batch[0]].question)
                    t0 = time.perf_counter()
                    with model.new_session(batch_size=len(batch), memory=memory, kv_dtype=kv_dtype) as session:
                        predicted = greedy_continuation(
                            session,
                            prompt[:, :question],
                            answer_len,
                            on_tokens=lambda n: bar.update(n * len(batch)),  # noqa: B023 (called in this iteration)
                            lead_in=prompt[:, question:],
                            aligned=offsets == 1,
                        )
                        predicted = predicted.cpu().numpy()
                        retrieved = session.retrieved_chunks()
                    seconds[length] += time.perf_counter() - t0
                    for row, i in enumerate(batch):
                        sample = samples[i]
                        exact, first = score_answer(predicted[row], sample.answer, sample.answer_lead)
                        evidence = (
                            None
                            if retrieved is None
                            else sample.evidence_chunks(model.config.chunk_size, session.prompt_offset)
                        )
                        results.append(
                            TrialResult(
                                length=length,
                                depth=depth,
                                trial=i,
                                exact=exact,
                                first_token=first,
                                retrieved_needle=None if evidence is None else evidence <= retrieved[row],
                                answer=task.tokenizer.decode(sample.answer.tolist()),
                                predicted=task.tokenizer.decode(predicted[row].tolist()),
                                evidence_chunks=None if evidence is None else len(evidence),
                            )
                        )
                    bar.update((length - question) * len(batch))  # the lead-in, the answer and the tail
    bar.close()
    summary = summarize(results, task.name, seconds)
    summary["question_offsets"] = question_offsets_label(model, task, offsets)
    summary["needle_jitter"] = needle_jitter
    return summary


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> list[float]:
    """Wilson score interval [low, high] for a success rate (95% at z=1.96). Unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or `trials` successes, which is
    where needle results usually sit: 20/20 gives [0.84, 1.0], 50/50 gives [0.93, 1.0]."""
    if trials <= 0:
        raise InputError(f"an interval needs at least one trial, got {trials}")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return [max(0.0, centre - half), min(1.0, centre + half)]


def summarize(results: list[TrialResult], task: str, seconds: dict[int, float] | None = None) -> dict[str, Any]:
    by_length: dict[int, list[TrialResult]] = defaultdict(list)
    by_cell: dict[tuple[int, float], list[TrialResult]] = defaultdict(list)
    for r in results:
        by_length[r.length].append(r)
        by_cell[(r.length, r.depth)].append(r)

    def rates(rows: list[TrialResult]) -> dict[str, Any]:
        exact = sum(r.exact for r in rows)
        out = {
            "trials": len(rows),
            "exact_match": exact / len(rows),
            "exact_match_ci95": wilson_interval(exact, len(rows)),
            "first_token": sum(r.first_token for r in rows) / len(rows),
        }
        if all(r.retrieved_needle is not None for r in rows):
            out["needle_retrieved"] = sum(bool(r.retrieved_needle) for r in rows) / len(rows)
        if all(r.evidence_chunks is not None for r in rows):
            # the trials whose evidence spans a chunk boundary: a retriever must fetch every piece
            split = [r for r in rows if r.evidence_chunks > 1]
            out["split_evidence"] = {"trials": len(split), "exact": sum(r.exact for r in split)}
        return out

    return {
        "task": task,
        "by_length": {str(k): {**rates(v), "seconds": (seconds or {}).get(k)} for k, v in sorted(by_length.items())},
        "by_cell": [{"length": k[0], "depth": k[1], **rates(v)} for k, v in sorted(by_cell.items())],
        "trials": [asdict(r) for r in results],
    }


METRICS = ("exact_match", "first_token", "needle_retrieved")


def check_needle_summary(summary: Any, where: str) -> None:
    """Refuse (InputError, naming `where`) anything but a needle summary as `summarize` writes it
    ("by_length": {length: {"exact_match": rate, ...}}): e.g. the results of `farsight eval
    generate`, `eval ruler` or `eval ppl`, whose tables hold other things."""
    fix = "give files written by `farsight eval passkey|multikey|niah2hop --out`"
    rows = summary.get("by_length") if isinstance(summary, dict) else None
    if not isinstance(rows, dict):
        what = (
            "an object without a table by length" if isinstance(summary, dict) else f"a JSON {type(summary).__name__}"
        )
        if isinstance(summary, dict) and isinstance(summary.get("overall"), dict):
            what = "the result of `farsight eval generate`"
        elif isinstance(summary, dict) and "tasks" in summary and "average" in summary:
            what = "the result of `farsight eval ruler`"
        raise InputError(f"{where} is not a needle-task result ({what}); {fix}")
    for n, row in rows.items():
        if not (str(n).isdigit() and isinstance(row, dict) and isinstance(row.get("exact_match"), (int, float))):
            raise InputError(
                f"{where} is not a needle-task result (its length {n!r} holds no exact_match rate; "
                f"a result of `farsight eval ppl`?); {fix}"
            )


def compare_summaries(
    summaries: list[tuple[str, dict[str, Any]]], metric: str = "exact_match"
) -> tuple[str, dict[str, dict[int, float]]]:
    """(label, needle summary as written by --out) pairs => (a table with one row per length and
    a column per label, in %; and the same numbers as plot series). "-" where a model was not
    run. Summaries that share a label are one model's grid run in parts: their lengths are joined,
    and a length in two of them is an InputError."""
    from farsight.eval.efficiency import format_table

    if metric not in METRICS:
        raise InputError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    series: dict[str, dict[int, float]] = {}
    for label, summary in summaries:
        check_needle_summary(summary, label)
        points = series.setdefault(label, {})
        for n, row in summary["by_length"].items():
            if int(n) in points:
                raise InputError(
                    f"two result files labelled {label!r} both hold length {format_length(int(n))}; "
                    "files may share a label only when they hold different lengths of one model"
                )
            if metric in row:
                points[int(n)] = 100 * row[metric]
    lengths = sorted({n for points in series.values() for n in points})
    rows = [{"length": format_length(n), **{label: series[label].get(n) for label in series}} for n in lengths]
    return format_table(rows, ["length", *series]), series


def results_table(summary: dict[str, Any], markdown: bool = False) -> str:
    from farsight.eval.efficiency import format_table

    rows = [
        {
            "length": format_length(int(k)),
            "trials": v["trials"],
            "exact match %": 100 * v["exact_match"],
            "95% interval": _interval_cell(v.get("exact_match_ci95")),
            "first token %": 100 * v["first_token"],
            "needle retrieved %": 100 * v["needle_retrieved"] if "needle_retrieved" in v else None,
            "split needle: exact": split_cell(v.get("split_evidence")),
            "seconds": v.get("seconds"),
        }
        for k, v in summary["by_length"].items()
    ]
    columns = ["length", "trials", "exact match %", "95% interval", "first token %", "needle retrieved %"]
    if any(row["split needle: exact"] is not None for row in rows):
        columns.append("split needle: exact")
    return format_table(rows, [*columns, "seconds"], markdown)


def split_cell(split: dict[str, int] | None) -> str | None:
    """The trials whose needle spans a chunk boundary: `2 of 8` exact, `-` where none did."""
    if split is None:
        return None
    return f"{split['exact']} of {split['trials']}" if split["trials"] else "-"


def _interval_cell(interval: list[float] | None) -> str | None:
    return None if interval is None else f"{100 * interval[0]:.0f}-{100 * interval[1]:.0f}"
