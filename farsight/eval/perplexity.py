"""Perplexity vs evaluation length on held-out documents (the extrapolation curve, DRT paper Fig. 3b).

For each length L the same `windows` windows of L tokens are drawn (from a seed) out of held-out
documents at least L long, or out of the concatenated split when no document is that long, and
every model scores every token of a window with its own cache, fed in blocks so memory stays bounded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from farsight.errors import InputError
from farsight.eval.needle import format_length

MIN_LENGTH = 2  # a window's first token is context only: a 1-token window scores nothing

def draw_windows(split: Any, length: int, count: int, seed: int) -> tuple[np.ndarray, str]:
    """[count, length] token windows and where they came from ("documents" or "concatenated")."""
    rng = np.random.default_rng([seed, length])
    docs = split.documents()
    long_docs = docs[(docs[:, 1] - docs[:, 0]) >= length]
    windows = []
    source = "documents" if len(long_docs) else "concatenated"
    for _ in range(count):
        if len(long_docs):
            start, end = long_docs[int(rng.integers(0, len(long_docs)))]
            offset = int(rng.integers(start, end - length + 1))
        else:
            if len(split) < length:
                raise InputError(f"the held-out split has {len(split)} tokens, fewer than the evaluation length {length}")
            offset = int(rng.integers(0, len(split) - length + 1))
        windows.append(np.asarray(split.tokens[offset : offset + length], dtype=np.int64))
    return np.stack(windows), source


def window_nll(model: Any, windows: torch.Tensor, block: int, memory: str, kv_dtype: str | None = None) -> torch.Tensor:
    """Mean next-token NLL (nats) of each window [B, L] -> [B]."""
    total = torch.zeros(windows.shape[0], dtype=torch.float64)
    with model.new_session(batch_size=windows.shape[0], memory=memory, kv_dtype=kv_dtype) as session:
        session.feed(windows[:, :1])  # not prefill: a document is scored from stream position 0, unaligned
        for start in range(1, windows.shape[1], block):
            total -= session.score(windows[:, start : start + block]).sum(1).double().cpu()
    return total / (windows.shape[1] - 1)


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
) -> dict[str, Any]:
    too_short = [length for length in lengths if length < MIN_LENGTH]
    if too_short:
        raise InputError(f"lengths {too_short} are too short; perplexity needs windows of at least {MIN_LENGTH} tokens")
    for name, value in (("windows", windows), ("batch_size", batch_size)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    device = next(model.parameters()).device
    results = {}
    bar = tqdm(total=len(lengths) * windows, unit="window", disable=not progress, dynamic_ncols=True, desc="ppl")
    for length in lengths:
        bar.set_postfix(length=format_length(length))
        data, source = draw_windows(split, length, windows, seed)
        nll = []
        for start in range(0, windows, batch_size):
            nll.append(window_nll(model, torch.from_numpy(data[start : start + batch_size]).to(device), block, memory, kv_dtype))
            bar.update(min(batch_size, windows - start))
        values = torch.cat(nll)
        mean = float(values.mean())
        results[str(length)] = {
            "nll": mean,
            "ppl": math.exp(mean),
            "nll_std": float(values.std()) if len(values) > 1 else 0.0,
            "windows": windows,
            "source": source,
        }
    bar.close()
    return {"by_length": results}
