"""`data.kind: sft` — batches of supervised examples (farsight.data.sft), the loss on their completions only.

Examples are grouped by length into buckets a quarter of an octave wide (lengths within 19% of
each other). A batch draws a bucket with probability proportional to its examples, then
`max(1, batch_tokens // the bucket's longest example)` of its examples at random (with
replacement, like the other kinds' windows; a batch is a pure function of seed, step,
micro-step and rank), and right-pads them to the longest of the batch. Every row starts with its
example's first token, so no example attends to another, and the padding (`pad_id`, label -100,
loss weight 0) only follows the real tokens: every model is causal, so it changes no real token's
logits. Packing several examples into one row is not offered: none of the attention kinds
(sliding window, GCA retrieval, CASTLE) can reset at a boundary inside a row, so packed examples
would read each other.

Each batch is input_ids, labels and loss_weights (1 on completion tokens and their eos, 0 on the
prompt and the padding: `causal_lm_loss`'s weights, as needle tasks weigh their answers). Held-out
batches also carry `answer_mask`, the completion tokens, for the trainer's answer accuracy.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from farsight.config import ConfigBase, ConfigError, require
from farsight.data.batch_source import batch_rng

logger = logging.getLogger(__name__)

BUCKETS_PER_OCTAVE = 4


@dataclass
class SFTBatchConfig(ConfigBase):
    """Supervised examples prepared by `farsight data prepare-sft`, batched by length.

    seq_len: the longest example a run takes (prompt, completion and eos); longer ones are refused,
    or left out with too_long: skip. batch_tokens: padded tokens per micro-batch (at least one
    example a batch, so at least seq_len).
    """

    path: str = ""
    seq_len: int = 4096
    batch_tokens: int = 16384
    too_long: str = "error"
    eval_split: str = "val"

    def validate(self) -> None:
        require(bool(self.path), "data.path is required: a directory written by `farsight data prepare-sft`")
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(
            self.batch_tokens >= self.seq_len,
            f"data.batch_tokens ({self.batch_tokens}) must be >= data.seq_len ({self.seq_len}): a batch holds at least one example",
        )
        require(self.too_long in ("error", "skip"), f"data.too_long must be 'error' or 'skip', got {self.too_long!r}")

    def describe(self, steps: int | None = None) -> str:
        """One line for a model card: what the batches are."""
        return (
            f"supervised examples of `{self.path}` (loss on the completions only), up to {self.seq_len:,} tokens each, "
            f"batched by length, about {self.batch_tokens:,} padded tokens per step"
        )


def length_bucket(length: int) -> int:
    """The bucket of an example of `length` tokens: lengths within a quarter octave share one."""
    return math.ceil(BUCKETS_PER_OCTAVE * math.log2(max(length, 1)))


class _Split:
    """One split's examples kept (not longer than seq_len), grouped by length bucket."""

    def __init__(self, data: Any, config: SFTBatchConfig, name: str) -> None:
        self.data = data
        lengths = data.lengths
        long = lengths > config.seq_len
        if long.any():
            n = int(long.sum())
            if config.too_long == "error":
                raise ConfigError(
                    f"{n:,} of the {len(lengths):,} {name} examples of {config.path} are longer than data.seq_len="
                    f"{config.seq_len:,} (the longest holds {int(lengths.max()):,} tokens); raise data.seq_len, set "
                    f"data.too_long: skip to leave them out, or prepare the data with --max-len {config.seq_len}"
                )
            logger.warning(f"note: leaving out the {n:,} {name} examples longer than data.seq_len={config.seq_len:,}")
        kept = np.flatnonzero(~long)
        require(len(kept) > 0, f"no {name} example of {config.path} fits data.seq_len={config.seq_len:,}")
        keys = np.asarray([length_bucket(int(n)) for n in lengths[kept]])
        self.buckets = [kept[keys == key] for key in np.unique(keys)]
        self.rows = [max(1, config.batch_tokens // int(lengths[members].max())) for members in self.buckets]
        sizes = np.asarray([len(members) for members in self.buckets], dtype=np.float64)
        self.p = sizes / sizes.sum()

    def batch(self, rng: np.random.Generator, pad_id: int) -> dict[str, torch.Tensor]:
        b = int(rng.choice(len(self.buckets), p=self.p))
        members, rows = self.buckets[b], self.rows[b]
        picked = rng.choice(members, size=rows, replace=len(members) < rows)
        return pad_examples([self.data.example(int(i)) for i in picked], pad_id)


def pad_examples(examples: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """(ids, loss mask) pairs right-padded into one batch: input_ids (pad_id after each example),
    labels (-100 there) and loss_weights (the mask; 0 there)."""
    width = max(len(ids) for ids, _ in examples)
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), -100, dtype=np.int64)
    weights = np.zeros((len(examples), width), dtype=np.float32)
    for row, (tokens, mask) in enumerate(examples):
        ids[row, : len(tokens)] = tokens
        labels[row, : len(tokens)] = tokens
        weights[row, : len(tokens)] = mask
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "loss_weights": torch.from_numpy(weights),
    }


class SFTBatches:
    # each batch is as wide as its longest example: train.compile=auto stays eager
    varying_shapes = True

    def __init__(self, config: SFTBatchConfig, seed: int, model: dict[str, Any] | None = None) -> None:
        from farsight.data.sft import SFTSplit

        self.config = config
        self.seed = seed
        train = SFTSplit(config.path, "train")
        self.tokenizer = train.tokenizer
        self.train = _Split(train, config, "train")
        self.val = _Split(SFTSplit(config.path, config.eval_split), config, config.eval_split)

    def digests(self) -> dict[str, str]:
        """A hash of the token files at data.path, which a resumed run compares."""
        from farsight.data.token_files import dataset_digest

        return {"data.path": dataset_digest(self.config.path)}

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return self.train.batch(batch_rng(self.seed, 0, step, micro, rank), self.tokenizer.pad_id)

    def eval_batch(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.val.batch(batch_rng(self.seed, 1, index), self.tokenizer.pad_id)
        return batch | {"answer_mask": batch["loss_weights"] > 0}
