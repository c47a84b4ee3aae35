"""Perplexity vs evaluation length on held-out documents (the extrapolation curve, DRT paper Fig. 3b).

`windows` disjoint windows of the LONGEST length are drawn (from a seed) out of held-out documents
at least that long, or out of the concatenated split when the documents do not hold enough of
them. Every model scores every token of every window once, with its own cache, fed in blocks so
memory stays bounded. The figure for a length L is the mean next-token NLL over the first L
tokens of those same windows: what the model scores on a document read from its start up to L.
So every length is measured on the same text, and a curve that falls with L shows the model
using the longer context rather than a change of documents.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from farsight.errors import InputError
from farsight.eval.needle import format_length
from farsight.progress import progress_bar

MIN_LENGTH = 2  # a window's first token is context only: a 1-token window scores nothing


def _slots(ranges: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """Start offsets of every disjoint `length`-token window inside the [start, end) ranges.

    Each range is tiled from a random shift in [0, its spare tokens], so the windows do not
    always begin at a document's first token.
    """
    starts = []
    for start, end in ranges:
        count = (end - start) // length
        if count:
            shift = int(rng.integers(0, end - start - count * length + 1))
            starts.append(start + shift + length * np.arange(count))
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def draw_windows(split: Any, length: int, count: int, seed: int) -> tuple[np.ndarray, str]:
    """[count, length] disjoint token windows and where they came from ("documents" or "concatenated").

    Documents at least `length` long are used when they hold `count` disjoint windows; otherwise
    the documents are taken as one concatenated stream.
    """
    rng = np.random.default_rng([seed, length])
    source = "documents"
    slots = _slots(split.documents(), length, rng)
    if len(slots) < count:
        source = "concatenated"
        slots = _slots(np.array([[0, len(split)]]), length, rng)
    if len(slots) < count:
        raise InputError(
            f"the held-out split ({len(split)} tokens) holds {len(slots)} disjoint windows of {length} tokens, "
            f"fewer than the {count} asked for; ask for --windows {len(slots)} or fewer, or a shorter length"
            if len(slots)
            else f"the held-out split has {len(split)} tokens, fewer than the {length:,}-token windows drawn from it "
            "(the longest length, or the window length); lower --lengths or --window-length, or hold out more text"
        )
    offsets = np.sort(rng.choice(slots, size=count, replace=False))
    return np.stack([np.asarray(split.tokens[o : o + length], dtype=np.int64) for o in offsets]), source


def token_nll(
    model: Any, windows: torch.Tensor, block: int, memory: str, kv_dtype: str | None = None, bar: Any = None
) -> torch.Tensor:
    """Next-token NLL (nats, float64) of every token after the first of each window [B, L] -> [B, L - 1].

    `bar` (a tqdm bar, optional) advances by the tokens scored after each block.
    """
    scores = []
    with model.new_session(batch_size=windows.shape[0], memory=memory, kv_dtype=kv_dtype) as session:
        session.feed(windows[:, :1])  # not prefill: a document is scored from stream position 0, unaligned
        for start in range(1, windows.shape[1], block):
            scores.append(session.score(windows[:, start : start + block]).double().cpu())
            if bar is not None:
                bar.update(scores[-1].numel())
    return -torch.cat(scores, dim=1)


def evaluate_perplexity(
    model: Any,
    split: Any,
    lengths: list[int],
    windows: int = 8,
    batch_size: int = 4,
    seed: int = 0,
    block: int = 2048,
    memory: str = "device",
    progress: bool = True,
    kv_dtype: str | None = None,
    window_length: int | None = None,
) -> dict[str, Any]:
    """{"by_length": {str(L): ...}, "window_length", "source"}.

    Per length L: nll / ppl over the first L tokens of every window, nll_std (the spread of the
    per-window means), nll_sem = nll_std / sqrt(windows), window_nll (the per-window means, for
    paired comparisons between models), and bucket_nll / window_bucket_nll over only the tokens
    from bucket_start (the next shorter length asked for) to L: how well the tokens that far in
    are predicted.
    `window_length` (default: the longest length) draws longer windows than are scored, so a
    model that cannot run as far (full attention) is scored on the first tokens of the very
    windows another run scored in full.
    """
    too_short = [length for length in lengths if length < MIN_LENGTH]
    if too_short:
        raise InputError(f"lengths {too_short} are too short; perplexity needs windows of at least {MIN_LENGTH} tokens")
    if not lengths:
        raise InputError("no evaluation lengths given; pass at least one, e.g. --lengths 4k,16k")
    for name, value in (("windows", windows), ("batch_size", batch_size)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    longest = max(lengths)
    window_length = longest if window_length is None else window_length
    if window_length < longest:
        raise InputError(
            f"the window length {window_length} is shorter than the longest evaluation length {longest}; raise it or drop the longer lengths"
        )
    device = next(model.parameters()).device
    data, source = draw_windows(split, window_length, windows, seed)
    data = data[:, :longest]
    # Running sums of the NLL over positions, per window: prefix means for every length.
    cumulative = torch.zeros(windows, longest, dtype=torch.float64)
    bar = progress_bar(
        total=windows * (longest - 1),
        unit="tok",
        unit_scale=True,
        disable=not progress,
        dynamic_ncols=True,
        desc=f"ppl {format_length(longest)}",
    )
    for start in range(0, windows, batch_size):
        batch = torch.from_numpy(data[start : start + batch_size]).to(device)
        cumulative[start : start + len(batch), 1:] = token_nll(model, batch, block, memory, kv_dtype, bar).cumsum(1)
    bar.close()
    results = {}
    previous = {length: max([p for p in lengths if p < length], default=1) for length in lengths}
    for length in lengths:
        per_window = cumulative[:, length - 1] / (length - 1)
        start = previous[length]
        bucket = (cumulative[:, length - 1] - cumulative[:, start - 1]) / (length - start)
        mean = float(per_window.mean())
        std = float(per_window.std()) if windows > 1 else None  # one window: no spread to estimate
        results[str(length)] = {
            "nll": mean,
            "ppl": math.exp(mean),
            "nll_std": std,
            "nll_sem": None if std is None else std / math.sqrt(windows),
            "window_nll": per_window.tolist(),
            "bucket_start": start,
            "bucket_nll": float(bucket.mean()),
            "window_bucket_nll": bucket.tolist(),
            "windows": windows,
            "source": source,
        }
    return {"by_length": results, "window_length": window_length, "source": source}


def paired_difference(values: list[float], baseline: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of values - baseline over the same windows (no error for one window)."""
    diff = torch.tensor(values, dtype=torch.float64) - torch.tensor(baseline, dtype=torch.float64)
    sem = float(diff.std()) / math.sqrt(len(diff)) if len(diff) > 1 else None
    return float(diff.mean()), sem


def format_error(sem: float | None) -> str:
    """A standard error for a table: "n/a" where one window gives none."""
    return "n/a" if sem is None else f"{sem:.4f}"
