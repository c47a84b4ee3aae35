"""`data.kind: sft` — batches of supervised examples (farsight.data.sft), the loss on their completions only.

Two ways to batch them, chosen by `data.pack`; either way a batch is a pure function of seed,
step, micro-step and rank (a resumed run sees the batches it would have seen), and examples are
drawn at random with replacement, like the other kinds' windows.

Length buckets (data.pack: false, the default). Examples are grouped by length into buckets a
quarter of an octave wide (lengths within 19% of each other). A batch draws a bucket with
probability proportional to its examples, then `max(1, batch_tokens // the bucket's longest
example)` of its examples, and right-pads them to the longest of the batch: one example a row,
from the row's first token, so no example attends to another.

Packed rows (data.pack: true). A batch has `max(1, batch_tokens // seq_len)` rows of at most
`seq_len` tokens and fills them first-fit: it draws examples one at a time, uniformly from all
the examples kept, and puts each at the end of the first row with room for the whole of it; the
first example that no row has room for ends the batch (it is not used, and no example is ever
split across rows or cut short). Since every example fits an empty row, no row is left empty,
and small examples drawn late fill the gaps that long ones left in earlier rows. Each batch also
carries `document_ids` (farsight.ops.documents): 0, 1, 2, ... for a row's examples in order, so
attention, CASTLE and DRT retrieval stay inside each example and the loss drops the prediction
from one example's last token to the next one's first. The only padding is what the shorter rows
lack of the longest; a batch holds up to `batch_tokens` real tokens, fewer by the room left at
the rows' ends. Weighting differs: a packed batch draws every example with the same probability,
so each example is trained about equally often, whereas length buckets give each bucket a share
of the batches (and so of the tokens) in proportion to its number of examples; and the example
that ends a batch, left out, is more often a long one.

Either way the rows are right-padded to the longest row of the batch only (`pad_id`, label -100,
loss weight 0, and in packed rows a document id of its own after the row's last example): every
model is causal, so padding after the real tokens changes no real token's logits.

Each batch is input_ids, labels and loss_weights (1 on completion tokens and their eos, 0 on the
prompt and the padding: `causal_lm_loss`'s weights, as needle tasks weigh their answers), and
document_ids when packed. Held-out batches also carry `answer_mask`, the completion tokens, for
the trainer's answer accuracy.
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
    """Supervised examples prepared by `farsight data prepare-sft`, batched by length or packed.

    seq_len: the longest example a run takes (prompt, completion and eos); longer ones are refused,
    or left out with too_long: skip. batch_tokens: padded tokens per micro-batch (at least one
    example a batch, so at least seq_len). pack: several examples end to end in rows of at most
    seq_len tokens, batch_tokens // seq_len rows a batch, told apart by `document_ids` (see the
    module doc), instead of one example a row batched by length.
    """

    path: str = ""
    seq_len: int = 4096
    batch_tokens: int = 16384
    too_long: str = "error"
    eval_split: str = "val"
    pack: bool = False

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
        if self.pack:
            rows = max(1, self.batch_tokens // self.seq_len)
            return (
                f"supervised examples of `{self.path}` (loss on the completions only), up to {self.seq_len:,} tokens each, "
                f"packed end to end into {rows} row{'s' if rows != 1 else ''} of up to {self.seq_len:,} tokens per step, "
                "each example attending only to itself"
            )
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
        self.kept = kept
        self.seq_len = config.seq_len
        self.pack = config.pack
        self.pack_rows = max(1, config.batch_tokens // config.seq_len)
        keys = np.asarray([length_bucket(int(n)) for n in lengths[kept]])
        self.buckets = [kept[keys == key] for key in np.unique(keys)]
        self.rows = [max(1, config.batch_tokens // int(lengths[members].max())) for members in self.buckets]
        sizes = np.asarray([len(members) for members in self.buckets], dtype=np.float64)
        self.p = sizes / sizes.sum()

    def batch(self, rng: np.random.Generator, pad_id: int) -> dict[str, torch.Tensor]:
        if self.pack:
            rows = first_fit(rng, self.kept, self.data.lengths, self.pack_rows, self.seq_len)
            return pack_examples([[self.data.example(int(i)) for i in row] for row in rows], pad_id)
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


def first_fit(
    rng: np.random.Generator, kept: np.ndarray, lengths: np.ndarray, rows: int, seq_len: int
) -> list[list[int]]:
    """The examples of one packed batch, row by row: examples drawn uniformly from `kept` (with
    replacement), each put in the first of `rows` rows of `seq_len` tokens with room for it, until
    one fits no row (that one is not used). Every length in `kept` must be at most `seq_len`."""
    packed: list[list[int]] = [[] for _ in range(rows)]
    room = [seq_len] * rows
    while True:
        index = int(kept[rng.integers(len(kept))])
        length = max(int(lengths[index]), 1)  # (an empty example, which no prepare writes, still ends the loop)
        row = next((r for r in range(rows) if room[r] >= length), None)
        if row is None:
            return packed
        packed[row].append(index)
        room[row] -= length


def pack_examples(rows: list[list[tuple[np.ndarray, np.ndarray]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of (ids, loss mask) pairs laid end to end, right-padded to the longest row: input_ids,
    labels (-100 on the padding), loss_weights (the masks; 0 on the padding) and document_ids (0, 1,
    2, ... for each row's examples in order, and the next id for its padding)."""
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    weights = np.zeros((len(rows), width), dtype=np.float32)
    documents = np.zeros((len(rows), width), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for document, (tokens, mask) in enumerate(row):
            end = at + len(tokens)
            ids[r, at:end] = tokens
            labels[r, at:end] = tokens
            weights[r, at:end] = mask
            documents[r, at:end] = document
            at = end
        documents[r, at:] = len(row)  # the padding: a document of its own after the row's last
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "loss_weights": torch.from_numpy(weights),
        "document_ids": torch.from_numpy(documents),
    }


class SFTBatches:
    # each batch is as wide as its longest example (packed: its longest row): train.compile=auto stays eager
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
