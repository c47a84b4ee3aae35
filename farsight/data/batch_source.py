"""What every training batch source shares: the `BatchSource` interface and the random stream of one batch.

A batch is a pure function of (seed, step, micro-step, rank), so a resumed run sees exactly the
batches it would have seen, and only the step needs saving.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class BatchSource(Protocol):
    """Training and evaluation batches as dicts of tensors (input_ids, labels, optionally loss_weights)."""

    tokenizer: Any

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]: ...

    def eval_batch(self, index: int) -> dict[str, torch.Tensor]: ...

    # optional: `digests() -> {config key: hash}` of the files the batches are read from, which
    # a checkpoint records and a resume compares (a source without files need not have it)
    # optional: `varying_shapes = True` where batch widths change from step to step (train.compile=auto
    # then stays eager: each new shape would recompile)
    # optional: `retrieval_weight` > 0 where batches hold `retrieval_targets` [B, L]: the trainer adds
    # the model's supervised retrieval loss so weighted (docs/design.md §2.7)


def batch_rng(seed: int, *stream: int) -> np.random.Generator:
    """Independent, reproducible random stream for one (seed, step, micro, rank, ...) tuple."""
    return np.random.default_rng([seed, *stream])
