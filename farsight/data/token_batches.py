"""`data.kind: tokens` — training batches of random windows from a prepared token directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from farsight.config import ConfigBase, require
from farsight.data.batch_source import batch_rng


@dataclass
class TokenBatchConfig(ConfigBase):
    """Random windows of `seq_len` tokens from a prepared token directory (`farsight data prepare`)."""

    path: str = ""
    seq_len: int = 512
    batch_size: int = 8
    eval_split: str = "val"

    def validate(self) -> None:
        require(bool(self.path), "data.path is required: a directory written by `farsight data prepare`")
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")

    def describe(self, steps: int | None = None) -> str:
        """One line for a model card: what the batches are."""
        return f"language modelling on `{self.path}`, {self.batch_size} windows of {self.seq_len:,} tokens per step"


class TokenBatches:
    def __init__(self, config: TokenBatchConfig, seed: int, model: dict[str, Any] | None = None) -> None:
        from farsight.data.token_files import load_token_dataset

        self.config = config
        self.seed = seed
        self.train = load_token_dataset(config.path, "train")
        self.val = load_token_dataset(config.path, config.eval_split)
        self.tokenizer = self.train.tokenizer
        for split in (self.train, self.val):
            require(
                len(split) > config.seq_len,
                f"{config.path} has only {len(split)} tokens in a split, fewer than data.seq_len={config.seq_len}; "
                "lower seq_len or prepare more text",
            )

    def digests(self) -> dict[str, str]:
        """What the batches are drawn from beyond the config: a hash of the token files at data.path
        (`farsight.data.token_files.dataset_digest`), which a resumed run compares."""
        from farsight.data.token_files import dataset_digest

        return {"data.path": dataset_digest(self.config.path)}

    def _windows(self, split: Any, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        n = self.config.seq_len
        starts = rng.integers(0, len(split) - n, size=self.config.batch_size)
        ids = torch.from_numpy(np.stack([np.asarray(split.tokens[s : s + n], dtype=np.int64) for s in starts]))
        return {"input_ids": ids, "labels": ids}

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return self._windows(self.train, batch_rng(self.seed, 0, step, micro, rank))

    def eval_batch(self, index: int) -> dict[str, torch.Tensor]:
        return self._windows(self.val, batch_rng(self.seed, 1, index))
