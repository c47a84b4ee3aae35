"""Generated answers scored against references (`farsight eval generate`): for each supervised
example of a JSONL file (farsight.data.sft), greedy generation through the model's Session from the
prompt the example trains on, scored with ROUGE-1/2/L (the `rouge-score` package) and exact
match, overall and by prompt length."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from farsight.data.sft import Example, prompt_ids
from farsight.errors import InputError, MissingDependencyError
from farsight.eval.needle import format_length, wilson_interval
from farsight.progress import progress_bar

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge_scorer() -> Any:
    """rouge_score's RougeScorer for ROUGE-1/2/L with Porter stemming (the summarization papers'
    setting); MissingDependencyError with the install command when the package is missing."""
    try:
        from rouge_score import rouge_scorer as module
    except ImportError as exc:
        raise MissingDependencyError(
            "scoring generated answers needs the rouge-score package: pip install farsight[rouge]"
        ) from exc
    return module.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def normalize_answer(text: str) -> str:
    """What exact match compares: the text with its whitespace runs made single spaces, stripped."""
    return " ".join(text.split())


@dataclass
class Answer:
    where: str
    prompt_tokens: int
    reference: str
    prediction: str
    stop: str  # "eos", "newline" or "length" (max_new_tokens reached)
    new_tokens: int
    exact: bool
    rouge1: float
    rouge2: float
    rougeL: float
    seconds: float


def greedy_answer(
    session: Any,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    decode: Callable[[list[int]], str],
    stop_at_newline: bool = False,
    on_tokens: Callable[[int], None] | None = None,
    block: int = 1 << 16,
) -> tuple[str, int, str]:
    """Prefill prompt [1, T] unaligned (from stream position 0, where every training example
    starts; in blocks of `block`, each reported to `on_tokens`), then decode greedily until eos,
    a newline (with `stop_at_newline`) or max_new_tokens. Returns (the text written before the
    stop, tokens written, why it stopped)."""

    def blocks():
        for start in range(0, prompt.shape[1], block):
            yield prompt[:, start : start + block]
            if on_tokens is not None:
                on_tokens(min(block, prompt.shape[1] - start))

    logits = session.prefill(blocks())  # no length given: fed as it is, without the session's alignment padding
    reserved = torch.tensor(list(session.model.reserved_ids().values()), dtype=torch.long, device=logits.device)
    written: list[int] = []
    for i in range(max_new_tokens):
        if reserved.numel():
            logits = logits.index_fill(-1, reserved, float("-inf"))
        token = int(logits[0].argmax())
        if token == eos_id:
            return decode(written), len(written), "eos"
        written.append(token)
        if stop_at_newline:
            text = decode(written)
            if "\n" in text:
                return text.split("\n", 1)[0], len(written), "newline"
        if i + 1 < max_new_tokens:
            logits = session.step(torch.tensor([token], device=logits.device))
    return decode(written), len(written), "length"


def in_bucket(length: int, low: int, high: int | None) -> bool:
    """Whether `length` falls in the (low, high] bucket (no upper edge for high=None)."""
    return low < length and (high is None or length <= high)


def length_buckets(lengths: Sequence[int], edges: Sequence[int] | None = None) -> list[tuple[int, int | None]]:
    """The (low, high] prompt-length buckets: between consecutive `edges` (and above the last), or
    by default between powers of two (up to the longest length). Only buckets holding a length are kept."""
    if edges is None:
        top = max(lengths)
        edges = [1 << k for k in range(max(1, math.ceil(math.log2(max(top, 2)))) + 1)]
    edges = sorted(set(edges))
    bounds = [(0, edges[0])] + list(zip(edges[:-1], edges[1:])) + [(edges[-1], None)]
    return [(lo, hi) for lo, hi in bounds if any(in_bucket(n, lo, hi) for n in lengths)]


def spread_per_bucket(lengths: Sequence[int], edges: Sequence[int] | None, per_bucket: int) -> list[int]:
    """Indices of at most `per_bucket` examples of each length bucket (`length_buckets`), spread
    evenly over the bucket's examples in file order: a held-out file grouped by source gives each
    bucket examples from all its sources, and the same file always gives the same choice."""
    chosen: list[int] = []
    for low, high in length_buckets(lengths, edges):
        members = [i for i, n in enumerate(lengths) if in_bucket(n, low, high)]
        if len(members) > per_bucket:
            members = [members[int(j * len(members) / per_bucket)] for j in range(per_bucket)]
        chosen.extend(members)
    return sorted(chosen)


def bucket_label(low: int, high: int | None) -> str:
    if high is None:
        return f">{format_length(low)}"
    return f"<={format_length(high)}" if low == 0 else f"{format_length(low)}-{format_length(high)}"


def _scores(rows: list[Answer]) -> dict[str, Any]:
    exact = sum(a.exact for a in rows)
    return {
        "examples": len(rows),
        "prompt_tokens_mean": float(np.mean([a.prompt_tokens for a in rows])),
        **{name: float(np.mean([getattr(a, name) for a in rows])) for name in ROUGE_TYPES},
        "exact_match": exact / len(rows),
        "exact_match_ci95": wilson_interval(exact, len(rows)),
        "new_tokens_mean": float(np.mean([a.new_tokens for a in rows])),
        "seconds": float(sum(a.seconds for a in rows)),
    }


def evaluate_answers(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    max_new_tokens: int = 64,
    stop_at_newline: bool = False,
    memory: str = "device",
    kv_dtype: str | None = None,
    buckets: Sequence[int] | None = None,
    per_bucket: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate an answer to each example's prompt (greedy, one example per session) and score it
    against the example's reference: ROUGE-1/2/L F1 (rouge-score, stemmed; its tokenizer keeps
    lowercased ASCII letters and digits) and exact match (whitespace-normalised). Returns
    {"overall", "by_length" (by prompt tokens, see `length_buckets`), "answers"}."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if per_bucket is not None and per_bucket < 1:
        raise InputError(f"per_bucket must be at least 1, got {per_bucket}")
    if not examples:
        raise InputError("no examples to evaluate")
    scorer = rouge_scorer()
    prompts = [prompt_ids(tokenizer, example) for example in examples]
    if per_bucket is not None:
        keep = spread_per_bucket([len(p) for p in prompts], buckets, per_bucket)
        examples, prompts = [examples[i] for i in keep], [prompts[i] for i in keep]
    vocab = model.config.vocab_size
    if max(int(p.max()) for p in prompts) >= vocab:
        raise InputError("the tokenizer's ids do not fit the model's vocabulary; use the model's own tokenizer")
    device = next(model.parameters()).device
    answers: list[Answer] = []
    bar = progress_bar(
        total=sum(len(p) for p in prompts), disable=not progress, unit="tok", unit_scale=True, dynamic_ncols=True
    )
    for example, ids in zip(examples, prompts):
        bar.set_postfix(example=f"{len(answers) + 1}/{len(examples)}", tokens=format_length(len(ids)))
        started = time.perf_counter()
        prompt = torch.from_numpy(ids)[None].to(device)
        with model.new_session(batch_size=1, memory=memory, kv_dtype=kv_dtype) as session:
            text, written, stop = greedy_answer(
                session, prompt, max_new_tokens, tokenizer.eos_id, tokenizer.decode, stop_at_newline, bar.update
            )
        scores = scorer.score(example.reference, text)
        answers.append(
            Answer(
                where=example.where,
                prompt_tokens=len(ids),
                reference=example.reference,
                prediction=text,
                stop=stop,
                new_tokens=written,
                exact=normalize_answer(text) == normalize_answer(example.reference),
                **{name: float(scores[name].fmeasure) for name in ROUGE_TYPES},
                seconds=time.perf_counter() - started,
            )
        )
    bar.close()
    by_length = []
    for low, high in length_buckets([a.prompt_tokens for a in answers], buckets):
        rows = [a for a in answers if in_bucket(a.prompt_tokens, low, high)]
        by_length.append({"bucket": bucket_label(low, high), "low": low, "high": high, **_scores(rows)})
    return {
        "overall": _scores(answers),
        "by_length": by_length,
        "scoring": {
            "rouge": "rouge-score, F1, Porter stemming",
            "exact_match": "whitespace-normalised equality",
        },
        "answers": [asdict(a) for a in answers],
    }


def answers_table(summary: dict[str, Any], markdown: bool = False) -> str:
    """One row per prompt-length bucket and one for all examples: ROUGE-1/2/L F1 and exact match in %."""
    from farsight.eval.efficiency import format_table

    def row(label: str, scores: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt tokens": label,
            "examples": scores["examples"],
            "ROUGE-1": 100 * scores["rouge1"],
            "ROUGE-2": 100 * scores["rouge2"],
            "ROUGE-L": 100 * scores["rougeL"],
            "exact match %": 100 * scores["exact_match"],
            "new tokens": scores["new_tokens_mean"],
            "seconds": scores["seconds"],
        }

    rows = [row(b["bucket"], b) for b in summary["by_length"]] + [row("all", summary["overall"])]
    columns = ["prompt tokens", "examples", "ROUGE-1", "ROUGE-2", "ROUGE-L", "exact match %", "new tokens", "seconds"]
    return format_table(rows, columns, markdown)
