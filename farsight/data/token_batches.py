"""`data.kind: tokens` — training batches of random windows from a prepared token directory.

A window is `seq_len` consecutive tokens of a split's stream, where documents lie end to end (each
ending with its eos), so a window may span several documents. With `data.pack: true` each batch
also carries `document_ids` [B, seq_len] (farsight.ops.documents): each token's document, counted
from 0 at the window's first token (found in the split's document offsets, `{split}.docs.npy`,
with np.searchsorted), so that no token attends across a document boundary and no document's last
token is trained to predict the next one's first. The windows themselves are the same either way.
"""

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
    pack: bool = False

    def validate(self) -> None:
        require(bool(self.path), "data.path is required: a directory written by `farsight data prepare`")
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(self.batch_size >= 1, f"data.batch_size must be >= 1, got {self.batch_size}")

    def describe(self, steps: int | None = None) -> str:
        """One line for a model card: what the batches are."""
        packed = ", each token attending within its own document (packed)" if self.pack else ""
        return f"language modelling on `{self.path}`, {self.batch_size} windows of {self.seq_len:,} tokens per step{packed}"


class TokenBatches:
    def __init__(self, config: TokenBatchConfig, seed: int, model: dict[str, Any] | None = None) -> None:
        from farsight.data.token_files import is_supervised, load_token_dataset

        require(
            not is_supervised(config.path),
            f"{config.path} holds supervised examples (written by `farsight data prepare-sft`): set data.kind: sft, "
            "which puts the loss on their completions (data.kind: tokens would train on the prompts too)",
        )
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
        # with data.pack, each split's document start offsets as TokenFile read and checked them
        # (`{split}.docs.npy`); unique: an empty document begins where the next one does
        self._offsets = {s.split: np.unique(s.documents()[:, 0]) for s in (self.train, self.val)} if config.pack else {}

    def digests(self) -> dict[str, str]:
        """What the batches are drawn from beyond the config: a hash of the token files at data.path
        (`farsight.data.token_files.dataset_digest`), which a resumed run compares."""
        from farsight.data.token_files import dataset_digest

        return {"data.path": dataset_digest(self.config.path)}

    def _windows(self, split: Any, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        n = self.config.seq_len
        starts = rng.integers(0, len(split) - n, size=self.config.batch_size)
        ids = torch.from_numpy(np.stack([np.asarray(split.tokens[s : s + n], dtype=np.int64) for s in starts]))
        if not self.config.pack:
            return {"input_ids": ids, "labels": ids}
        return {
            "input_ids": ids,
            "labels": ids,
            "document_ids": window_document_ids(self._offsets[split.split], starts, n),
        }

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return self._windows(self.train, batch_rng(self.seed, 0, step, micro, rank))

    def eval_batch(self, index: int) -> dict[str, torch.Tensor]:
        return self._windows(self.val, batch_rng(self.seed, 1, index))


def window_document_ids(offsets: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """[len(starts), seq_len] document ids of the windows [s, s + seq_len) of a token stream whose
    documents begin at `offsets` (strictly increasing, the first 0): 0 for the document a window
    starts in, one more at each document that begins inside it."""
    positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)
    documents = np.searchsorted(offsets, positions, side="right")  # the documents begun at or before each token
    return torch.from_numpy(documents - documents[:, :1])
