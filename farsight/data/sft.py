"""Supervised examples (`data.kind: sft`): a prompt and the completion to learn, read from JSONL,
rendered, tokenized and written once as token files with a loss mask (`farsight data prepare-sft`).

Records, one JSON object per line (blank lines are skipped; other keys, such as an "id", are ignored):

    {"prompt": "...", "completion": "..."}
        the prompt's tokens, the completion's, then eos; the loss covers the completion and the eos.
        No template: each text is tokenized as given, on its own, so the boundary is exact.
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
        rendered with the chat template below; the loss covers every assistant message's content
        and the eos that ends it; the last message must be the assistant's (the answer to learn).

The chat template (CHAT_TEMPLATE): each message is its role header `<|role|>` on a line of its
own, then its content; a system or user message ends with a newline, an assistant message with
the tokenizer's eos token. A system and a user message, answered:

    <|system|>\\nBe brief.\\n<|user|>\\nSummarize: ...\\n<|assistant|>\\nA summary.<eos>

The headers are ordinary text (the tokenizers never turn text into special ids). Generation
(`farsight eval generate`) feeds everything up to and including the last `<|assistant|>\\n` and
scores what the model writes up to its eos.

On disk (docs/data.md): the token-file layout of farsight.data.token_files, one document per
example, plus `train.mask.bin` / `val.mask.bin`: one uint8 per token, 1 where the token is in
the loss. meta.json's "sft" section records the template, the length limit and what was skipped.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from farsight.data.tokenizers import Tokenizer, load_tokenizer
from farsight.errors import FarsightError, MissingFileError
from farsight.progress import progress_bar
from farsight.readers import json_kind

logger = logging.getLogger(__name__)

CHAT_TEMPLATE = "farsight-chat-v1"
ROLES = ("system", "user", "assistant")
MASK_SUFFIX = ".mask.bin"
SKIP_FLAG = "--skip-bad-records"
_BATCH_EXAMPLES = 256


class SFTDataError(FarsightError, ValueError):
    """A supervised-example file or record cannot be used; the message names the file, the line and the fix."""


class BadRecord(Exception):
    """Why one record cannot be used: `kind` (a short class of problem, for the skip counts) and a message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Example:
    """One supervised example: its text segments in order, each (text, in the loss), a text of
    None standing for the eos token; the final answer starts at segments[answer_start], and
    `reference` is its text (what generation is scored against)."""

    where: str
    segments: tuple[tuple[str | None, bool], ...]
    answer_start: int
    reference: str

    @property
    def prompt_segments(self) -> tuple[tuple[str | None, bool], ...]:
        """What is fed before the final answer."""
        return self.segments[: self.answer_start]


def _string(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord("wrong type", f'"{key}" must be a string, got {type(value).__name__}')
    return value


def _merge(segments: list[tuple[str | None, bool]]) -> tuple[tuple[str | None, bool], ...]:
    """Adjacent texts with the same loss flag joined (and empty texts dropped), so each is tokenized as one."""
    merged: list[tuple[str | None, bool]] = []
    for text, loss in segments:
        if text == "":
            continue
        if text is not None and merged and merged[-1][0] is not None and merged[-1][1] == loss:
            merged[-1] = (merged[-1][0] + text, loss)
        else:
            merged.append((text, loss))
    return tuple(merged)


def parse_record(record: Any, where: str) -> Example:
    """The Example of one decoded JSONL record; BadRecord says why a record cannot be one."""
    if not isinstance(record, dict):
        raise BadRecord("not an object", f"a JSON {json_kind(record)} where a JSON object belongs")
    has_pair = "prompt" in record or "completion" in record
    if "messages" in record:
        if has_pair:
            raise BadRecord(
                "missing field", 'the record has both "messages" and "prompt"/"completion"; keep one of the two forms'
            )
        return _parse_chat(record["messages"], where)
    if not has_pair:
        keys = ", ".join(sorted(map(str, record))) or "(none)"
        raise BadRecord(
            "missing field", f'the record has neither "prompt" and "completion" nor "messages" (its keys: {keys})'
        )
    for key in ("prompt", "completion"):
        if key not in record:
            other = "completion" if key == "prompt" else "prompt"
            raise BadRecord("missing field", f'the record has "{other}" but no "{key}"')
    prompt, completion = _string(record, "prompt"), _string(record, "completion")
    if not completion:
        raise BadRecord("empty completion", "empty completion: nothing to learn")
    if not prompt:
        raise BadRecord("empty prompt", "empty prompt: the completion's first token would have nothing to follow")
    segments = ((prompt, False), (completion, True), (None, True))
    return Example(where, segments, 1, completion)


def _parse_chat(messages: Any, where: str) -> Example:
    if not isinstance(messages, list) or not messages:
        raise BadRecord("bad messages", '"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    segments: list[tuple[str | None, bool]] = []
    answer_start = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadRecord("bad messages", f'message {i} must be an object with "role" and "content"')
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise BadRecord("bad messages", f"message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord("wrong type", f'message {i}: "content" must be a string, got {type(content).__name__}')
        if role == "assistant":
            if not content:
                raise BadRecord("empty completion", f"message {i} (assistant) is empty: nothing to learn")
            segments.append(("<|assistant|>\n", False))
            answer_start = len(_merge(segments))
            segments += [(content, True), (None, True)]
        else:
            segments.append((f"<|{role}|>\n{content}\n", False))
    last = messages[-1]["role"]
    if last != "assistant":
        raise BadRecord(
            "bad messages", f"the last message is the {last}'s; it must be the assistant's (the answer to learn)"
        )
    return Example(where, _merge(segments), answer_start, messages[-1]["content"])


@dataclass
class SkippedRecords:
    """The bad records left out (with `--skip-bad-records`): a count per kind of problem and where each kind was first met."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, bad: BadRecord, where: str) -> None:
        self.counts[bad.kind] += 1
        self.first.setdefault(bad.kind, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line: how many records were left out, and why."""
        parts = ", ".join(f"{n} {kind} (first at {self.first[kind]})" for kind, n in self.counts.most_common())
        return f"skipped {self.total} bad record{'s' if self.total != 1 else ''}: {parts}"


def refuse(bad: BadRecord, where: str, flag: str = SKIP_FLAG) -> SFTDataError:
    """The one-line error of a bad record: where, why, and the fix."""
    return SFTDataError(f"{where}: {bad.message}; fix or remove the record, or pass {flag} to leave such records out")


def read_examples(path: str | os.PathLike[str], skipped: SkippedRecords | None = None) -> Iterator[Example]:
    """The examples of the JSONL file `path`, in order. A bad record stops the reading with an
    SFTDataError naming FILE:LINE, or, when `skipped` is given, is counted there and left out.
    Invalid UTF-8 bytes are read as U+FFFD."""
    from farsight.data.corpora import jsonl_lines

    path = Path(path)
    check_jsonl_file(path)
    for number, line in jsonl_lines(path, SFTDataError):
        where = f"{path}:{number}"
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise BadRecord("invalid JSON", f"invalid JSON ({error.msg} at column {error.colno})") from None
            example = parse_record(record, where)
        except BadRecord as bad:
            if skipped is None:
                raise refuse(bad, where) from None
            skipped.add(bad, where)
            continue
        yield example


def check_jsonl_file(path: str | os.PathLike[str]) -> None:
    """Refuse (MissingFileError) a path that is not a readable file."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise MissingFileError(f"{path} {what}; pass a JSONL file of prompt/completion or messages records")


def encode_segments(tokenizer: Tokenizer, segments: Iterable[tuple[str | None, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, loss mask uint8) of segments; a None text is the tokenizer's eos."""
    segments = list(segments)
    texts = [text for text, _ in segments if text is not None]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    return _assemble(tokenizer, segments, encoded)


def _assemble(
    tokenizer: Tokenizer, segments: Sequence[tuple[str | None, bool]], encoded: Iterator[list[int]]
) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    mask: list[int] = []
    for text, loss in segments:
        piece = [tokenizer.eos_id] if text is None else next(encoded)
        ids += piece
        mask += [int(loss)] * len(piece)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def encode_examples(tokenizer: Tokenizer, examples: Sequence[Example]) -> list[tuple[np.ndarray, np.ndarray]]:
    """encode_segments of each example, the texts of all of them tokenized in one batch."""
    texts = [text for example in examples for text, _ in example.segments if text is not None]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    return [_assemble(tokenizer, example.segments, encoded) for example in examples]


def prompt_ids(tokenizer: Tokenizer, example: Example) -> np.ndarray:
    """The ids generation is fed: the example's tokens before its final answer, as in training."""
    return encode_segments(tokenizer, example.prompt_segments)[0]


def check_length(ids: np.ndarray, mask: np.ndarray, max_len: int | None) -> None:
    """BadRecord("too long") for an example of more than max_len tokens."""
    if max_len is not None and len(ids) > max_len:
        answer = int(mask.sum())
        raise BadRecord(
            "too long",
            f"the example holds {len(ids):,} tokens ({len(ids) - answer:,} of context, {answer:,} to learn with the eos), "
            f"more than --max-len {max_len:,}",
        )


# ---- token files ---------------------------------------------------------------------------------


def prepare_sft(
    sources: Sequence[str | os.PathLike[str]],
    tokenizer: Tokenizer | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    val_sources: Sequence[str | os.PathLike[str]] = (),
    val_fraction: float = 0.05,
    seed: int = 0,
    max_len: int | None = None,
    skip_bad_records: bool = False,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize the supervised examples of the JSONL files `sources` into train/val token files
    with loss masks under `out_dir`; returns meta.json's dict.

    The held-out split is `val_sources` when given, else the records of `sources` whose
    `split_score("FILE:LINE", seed)` is below `val_fraction` (both splits get at least one).
    Examples longer than `max_len` tokens (eos included) are bad records: refused with FILE:LINE,
    like records that are not JSON, lack their fields or have an empty completion, or, with
    `skip_bad_records`, left out and counted (meta.json's sft.skipped). Written like
    `prepare_corpus`: atomically, a failure leaving an earlier dataset in `out_dir` as it was; an
    `out_dir` holding anything but a dataset is refused unless `overwrite`."""
    from farsight.data.token_files import TokenDataError, check_held_out_apart, token_dtype, write_dataset_directory

    if isinstance(sources, (str, os.PathLike)) or not sources:
        raise SFTDataError("sources must be a non-empty list of JSONL files")
    if isinstance(val_sources, (str, os.PathLike)):
        val_sources = [val_sources]
    for path in [*sources, *val_sources]:
        check_jsonl_file(path)
    check_held_out_apart([(str(p), Path(p)) for p in sources], [(str(p), Path(p)) for p in val_sources])
    if not val_sources and not 0.0 < val_fraction < 1.0:
        raise SFTDataError(f"val_fraction={val_fraction} must be strictly between 0 and 1 so both splits get examples")
    if max_len is not None and max_len < 2:
        raise SFTDataError(f"max_len must be at least 2 tokens (a prompt token and a completion token), got {max_len}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TokenDataError(f"{out} is a file, not a folder; pass a new folder (or a prepared dataset to replace)")
    plan = [(Path(p), None) for p in sources] + [(Path(p), "val") for p in val_sources]
    if val_sources:
        plan = [(path, split or "train") for path, split in plan]
    result: dict[str, Any] = {}

    def fill(scratch: Path) -> None:
        result["meta"] = _write_sft(scratch, plan, tok, dtype, val_fraction, seed, max_len, skip_bad_records, progress)

    masks = tuple(f"{split}{MASK_SUFFIX}" for split in ("train", "val"))
    write_dataset_directory(out, fill, extra_files=masks, overwrite=overwrite, what="a supervised dataset prepare")
    return result["meta"]


def _write_sft(
    scratch: Path,
    plan: list[tuple[Path, str | None]],
    tok: Tokenizer,
    dtype: np.dtype,
    val_fraction: float,
    seed: int,
    max_len: int | None,
    skip_bad_records: bool,
    progress: bool,
) -> dict[str, Any]:
    from farsight.data.token_files import (
        FORMAT_NAME,
        FORMAT_VERSION,
        META_FILENAME,
        SPLITS,
        _farsight_version,
        _HeldBackSplitter,
        _Pending,
        _SplitWriter,
        split_score,
    )
    from farsight.files import sha256_file

    counts = [
        {"documents": 0, "train_documents": 0, "val_documents": 0, "train_tokens": 0, "val_tokens": 0} for _ in plan
    ]
    skipped = SkippedRecords()
    per_source_skipped = [0] * len(plan)
    handles = {}
    try:
        for split in SPLITS:
            handles[split] = (open(scratch / f"{split}.bin", "wb"), open(scratch / f"{split}{MASK_SUFFIX}", "wb"))
        writers = {split: _SplitWriter(ids, masks=masks) for split, (ids, masks) in handles.items()}
        splitter = _HeldBackSplitter(writers, counts, val_fraction)
        with progress_bar(desc="tokenizing", unit=" examples", disable=not progress, dynamic_ncols=True) as bar:

            def flush(batch: list[Example], index: int, path: Path, split: str | None) -> None:
                for example, (ids, mask) in zip(batch, encode_examples(tok, batch)):
                    try:
                        check_length(ids, mask, max_len)
                    except BadRecord as bad:
                        if not skip_bad_records:
                            raise refuse(bad, example.where) from None
                        skipped.add(bad, example.where)
                        continue
                    counts[index]["documents"] += 1
                    pending = _Pending(ids.astype(dtype), 0.0, index, mask)
                    if split is None:  # the record's id, FILENAME:LINE, places it (not where the file lies)
                        pending.score = split_score(f"{path.name}:{example.where.rsplit(':', 1)[1]}", seed)
                        splitter.add(pending)
                    else:
                        writers[split].write(pending.ids, mask)
                        counts[index][f"{split}_documents"] += 1
                        counts[index][f"{split}_tokens"] += len(ids)
                bar.update(len(batch))

            for index, (path, split) in enumerate(plan):
                bar.set_description_str(f"tokenizing {path.name}")
                before = skipped.total
                batch: list[Example] = []
                for example in read_examples(path, skipped if skip_bad_records else None):
                    batch.append(example)
                    if len(batch) >= _BATCH_EXAMPLES:
                        flush(batch, index, path, split)
                        batch = []
                if batch:
                    flush(batch, index, path, split)
                per_source_skipped[index] = skipped.total - before
                if counts[index]["documents"] == 0:
                    raise SFTDataError(
                        f"{path} holds no usable example"
                        + (f" ({skipped.summary()})" if skipped.total > before else "")
                        + "; check that it is a JSONL file of prompt/completion or messages records"
                    )
        splitter.finish()
        for ids, masks in handles.values():
            for handle in (ids, masks):
                handle.flush()
                os.fsync(handle.fileno())
    finally:
        for pair in handles.values():
            for handle in pair:
                handle.close()
    total = sum(c["documents"] for c in counts)
    if total < 2:
        raise SFTDataError(f"the files hold {total} usable example(s); a train and a held-out split need at least 2")
    for split in SPLITS:
        if not writers[split].starts:
            raise SFTDataError(
                f"the {split} split got no example; give {'--val files with' if split == 'val' else '--source files with'} usable records"
            )
    checksums = {}
    splits = {}
    for split in SPLITS:
        writer = writers[split]
        starts = np.asarray(writer.starts, dtype=np.int64)
        with open(scratch / f"{split}.docs.npy", "wb") as handle:
            np.save(handle, starts)
        lengths = np.diff(np.append(starts, writer.tokens))
        mask_tokens = int(np.fromfile(scratch / f"{split}{MASK_SUFFIX}", dtype=np.uint8).sum(dtype=np.int64))
        checksums[f"{split}.bin"] = writer.digest.hexdigest()
        checksums[f"{split}{MASK_SUFFIX}"] = writer.mask_digest.hexdigest()
        checksums[f"{split}.docs.npy"] = sha256_file(scratch / f"{split}.docs.npy")
        splits[split] = {
            "tokens": writer.tokens,
            "documents": len(starts),
            "file": f"{split}.bin",
            "offsets_file": f"{split}.docs.npy",
            "mask_file": f"{split}{MASK_SUFFIX}",
            "loss_tokens": mask_tokens,
            "longest": int(lengths.max()),
        }
    sources = []
    for (path, split), count, left_out in zip(plan, counts, per_source_skipped):
        sources.append(
            {
                "spec": f"sft:{path}",
                "kind": "sft-jsonl",
                "split": split or "train/val by record",
                "examples": count["documents"],
                **{f"{s}_examples": count[f"{s}_documents"] for s in SPLITS},
                **{f"{s}_tokens": count[f"{s}_tokens"] for s in SPLITS},
                "skipped": left_out,
            }
        )
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "farsight_version": _farsight_version(),
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.to_spec(),
        "append_eos": True,
        "val_fraction": None if any(split for _, split in plan) else val_fraction,
        "seed": seed,
        "splits": splits,
        "sources": sources,
        "sft": {
            "template": CHAT_TEMPLATE,
            "loss": "completions and every assistant message, each with its eos",
            "max_len": max_len,
            "skipped": dict(skipped.counts),
        },
        "checksums": dict(sorted(checksums.items())),
    }
    if skipped.total:
        logger.warning(f"note: {skipped.summary()}")
    tok.save(scratch)
    (scratch / META_FILENAME).write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
    return meta


class SFTSplit:
    """One split of a dataset written by `prepare_sft`: each example's ids and loss mask."""

    def __init__(self, directory: str | os.PathLike[str], split: str = "train") -> None:
        from farsight.data.token_files import TokenDataError, TokenFile, prepare_again
        from farsight.readers import check_file

        self.directory = Path(directory)
        self.tokens = TokenFile(self.directory, split, sft=True)
        fix = prepare_again(self.directory, sft=True)
        meta = self.tokens.meta
        if not isinstance(meta.get("sft"), dict):
            raise TokenDataError(
                f"{self.directory} holds token files for language modelling (`farsight data prepare`), not supervised "
                f"examples; prepare them with `farsight data prepare-sft --source FILE.jsonl --out {self.directory}`"
            )
        path = self.directory / meta["splits"][split].get("mask_file", f"{split}{MASK_SUFFIX}")
        count = len(self.tokens)
        if not path.exists():
            raise TokenDataError(f"{path} is missing although meta.json lists it; {fix}")
        if check_file(path, fix, TokenDataError, empty_ok=True) != count:
            raise TokenDataError(
                f"{path} does not hold one byte per token of the {split} split ({count:,} tokens); {fix}"
            )
        self.mask = np.memmap(path, dtype=np.uint8, mode="r", shape=(count,)) if count else np.zeros(0, np.uint8)
        ranges = self.tokens.documents()
        self.starts = ranges[:, 0]
        self.lengths = ranges[:, 1] - ranges[:, 0]

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tokens.tokenizer

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, loss mask uint8) of example `index`."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        return (
            np.asarray(self.tokens.tokens[start : start + length], dtype=np.int64),
            np.asarray(self.mask[start : start + length]),
        )
