"""Token files: a corpus tokenized once into flat numpy memmaps, split into train/val by document.

Layout of a prepared directory (see docs/data.md):

    train.bin, val.bin              every document's ids back to back (uint16, or uint32 for vocabularies over 65536)
    train.docs.npy, val.docs.npy    int64 start offset of each document in the .bin
    tokenizer.json                  the tokenizer spec (`load_tokenizer(DIR)` rebuilds it)
    meta.json                       dtype, counts, tokenizer spec, sources and licenses

meta.json is written last, so a directory without it is not a dataset, whatever else it holds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from farsight.data.corpora import resolve_source
from farsight.data.documents import Document, Source
from farsight.data.tokenizers import TOKENIZER_FILENAME, Tokenizer, load_tokenizer, tokenizer_from_spec
from farsight.errors import FarsightError
from farsight.files import atomic_directory, sha256_file, writing_folder
from farsight.progress import progress_bar
from farsight.readers import check_file, load_npy, read_json, refusal, require_fields

FORMAT_NAME = "farsight-tokens"
FORMAT_VERSION = 1
META_FILENAME = "meta.json"
SPLITS = ("train", "val")

# Documents are tokenized in batches (the Rust tokenizers parallelise within a batch); the
# character cap keeps memory bounded when documents are whole books.
_BATCH_DOCUMENTS = 256
_BATCH_CHARACTERS = 8_000_000


class TokenDataError(FarsightError, ValueError):
    """A prepared dataset is missing, incomplete or inconsistent; the message names the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise TokenDataError(f"vocab_size {vocab_size} does not fit in 32-bit token files")


def split_score(doc_id: str, seed: int = 0) -> float:
    """A number in [0, 1) fixed by (seed, doc_id): documents scoring below val_fraction go to val."""
    digest = hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def _prepare_command(out_dir: Path | str, sft: bool = False) -> str:
    if sft:
        return f"run `farsight data prepare-sft --source FILE.jsonl --tokenizer byte|gpt2|PATH --out {out_dir}` first"
    return f"run `farsight data prepare --source SOURCE --tokenizer byte|gpt2|PATH --out {out_dir}` first"


# the loss masks that only a dataset of supervised examples (`farsight data prepare-sft`) holds
_SFT_MASK_FILES = ("train.mask.bin", "val.mask.bin")
_TOKEN_DTYPES = ("uint16", "uint32")
_META_FIELDS = {"dtype": str, "vocab_size": int, "tokenizer": dict, "splits": dict}
_SPLIT_FIELDS = {"tokens": int, "documents": int, "file": str, "offsets_file": str}


def is_supervised(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds supervised examples (the loss masks `farsight data prepare-sft` writes)."""
    return any((Path(directory) / name).exists() for name in _SFT_MASK_FILES)


def prepare_again(directory: Path, sft: bool | None = None) -> str:
    """The fix of a damaged dataset: the prepare command that wrote it (`sft`: supervised
    examples; None: told by the loss masks in `directory`), run again."""
    if sft is None:
        sft = is_supervised(directory)
    command = "farsight data prepare-sft --source FILE.jsonl" if sft else "farsight data prepare --source SOURCE"
    return f"prepare the dataset again (`{command} ... --out {directory}`)"


def _farsight_version() -> str:
    try:
        return importlib.metadata.version("farsight")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


@dataclass
class _Pending:
    """A tokenized document waiting to be written (with its loss mask, for supervised examples)."""

    ids: np.ndarray
    score: float
    source_index: int
    mask: np.ndarray | None = None


@dataclass
class _SplitWriter:
    """Appends documents to one split's temporary .bin (and, for supervised examples, their loss
    masks to its .mask.bin, one uint8 per token) and records where each starts."""

    handle: BinaryIO
    starts: list[int] = field(default_factory=list)
    tokens: int = 0
    digest: Any = field(default_factory=hashlib.sha256)  # of the bytes written, for meta.json's checksums
    masks: BinaryIO | None = None
    mask_digest: Any = field(default_factory=hashlib.sha256)

    def write(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.starts.append(self.tokens)
        data = ids.tobytes()
        self.handle.write(data)
        self.digest.update(data)
        self.tokens += len(ids)
        if self.masks is not None:
            assert mask is not None and len(mask) == len(ids)
            data = np.asarray(mask, dtype=np.uint8).tobytes()
            self.masks.write(data)
            self.mask_digest.update(data)


class _HeldBackSplitter:
    """Streams documents into train/val by hash while guaranteeing both splits end up non-empty.

    The train document with the lowest score (the one closest to qualifying for val) and the
    val document with the highest score are held back instead of written. At the end, if one
    split received nothing, the other split's held document moves to it; otherwise each held
    document goes where its score put it. Everything depends only on the documents and the
    seed, so the result is deterministic.
    """

    def __init__(
        self,
        writers: dict[str, _SplitWriter],
        counts: list[dict[str, int]],
        val_fraction: float,
        fixed: Sequence[str] = (),
    ) -> None:
        self.writers = writers
        self.counts = counts
        self.val_fraction = val_fraction
        self.fixed = fixed  # per source, the split all its documents go to (empty: by hash)
        self.held: dict[str, _Pending | None] = {"train": None, "val": None}

    def add(self, pending: _Pending) -> None:
        if self.fixed:
            self._write(self.fixed[pending.source_index], pending)
            return
        split = "val" if pending.score < self.val_fraction else "train"
        held = self.held[split]
        # Train keeps its lowest score in hand, val its highest: the best candidates to move.
        better = held is None or (pending.score < held.score if split == "train" else pending.score > held.score)
        if better:
            self.held[split] = pending
            pending = held  # type: ignore[assignment]
        if pending is not None:
            self._write(split, pending)

    def finish(self) -> None:
        train, val = self.held["train"], self.held["val"]
        if val is None and not self.writers["val"].starts and train is not None:
            self.held["train"], self.held["val"] = None, train
        elif train is None and not self.writers["train"].starts and val is not None:
            self.held["train"], self.held["val"] = val, None
        for split in SPLITS:
            held = self.held[split]
            if held is not None:
                self._write(split, held)

    def _write(self, split: str, pending: _Pending) -> None:
        self.writers[split].write(pending.ids, pending.mask)
        self.counts[pending.source_index][f"{split}_documents"] += 1
        self.counts[pending.source_index][f"{split}_tokens"] += len(pending.ids)


def prepare_corpus(
    sources: Sequence[str | os.PathLike[str] | Source],
    tokenizer: Tokenizer | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    val_fraction: float = 0.05,
    seed: int = 0,
    append_eos: bool = True,
    progress: bool = True,
    val_sources: Sequence[str | os.PathLike[str] | Source] = (),
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize every document of `sources` into train/val token files under `out_dir`; return the meta dict.

    Each document goes to val when `split_score(doc_id, seed) < val_fraction`, else to train,
    so a document never appears in both and the split does not depend on source order or on
    the tokenizer. With two or more documents both splits get at least one. With `val_sources`,
    the held-out split is every document of those sources and nothing else (a split made by
    the caller, e.g. whole packages or books held out), and `val_fraction` is not used. `eos_id` follows
    every document when `append_eos`. Sources are spec strings for `resolve_source` or
    `Source` objects (to pass options such as `text_field`).

    A new `out_dir` is written as a temporary folder beside it and renamed into place at the end;
    into an existing folder (a dataset to replace) the new files go through a temporary folder
    inside it and replace the old ones at the end, meta.json last. Either way a failed or interrupted run (a full disk,
    Ctrl-C) removes what it wrote and leaves any previous dataset there untouched. meta.json
    records the SHA-256 of every token file (`dataset_digest`). An `out_dir` holding anything
    but a dataset (a model, a tokenizer, a run, other files) is refused unless `overwrite`, and a
    second process preparing into the same `out_dir` meanwhile is refused
    (`write_dataset_directory`).
    """
    if isinstance(sources, (str, os.PathLike)) or not sources:
        raise TokenDataError(
            "sources must be a non-empty list of source specs, e.g. ['shakespeare'] or ['stdlib', 'notes/']"
        )
    if isinstance(val_sources, (str, os.PathLike)):
        val_sources = [val_sources]
    if not val_sources and not 0.0 < val_fraction < 1.0:
        raise TokenDataError(
            f"val_fraction={val_fraction} must be strictly between 0 and 1 so both splits get documents"
        )
    resolved = [source if isinstance(source, Source) else resolve_source(source) for source in sources]
    held_out = [source if isinstance(source, Source) else resolve_source(source) for source in val_sources]
    _check_apart(resolved, held_out)
    fixed = ["train"] * len(resolved) + ["val"] * len(held_out) if held_out else []
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TokenDataError(f"{out} is a file, not a folder; pass a new folder (or a prepared dataset to replace)")
    result: dict[str, Any] = {}

    def fill(scratch: Path) -> None:
        result["meta"] = _write_dataset(
            scratch, resolved + held_out, tok, dtype, val_fraction, seed, append_eos, progress, fixed
        )

    write_dataset_directory(out, fill, overwrite=overwrite)
    return result["meta"]


def _source_path(source: Source) -> Path | None:
    """The file or folder a source reads, where it reads one."""
    where = getattr(source, "path", None) or getattr(source, "root", None)
    return Path(where).resolve() if where is not None else None


def _check_apart(train: Sequence[Source], held_out: Sequence[Source]) -> None:
    """`check_held_out_apart` of sources."""
    check_held_out_apart(
        [(source.spec, _source_path(source)) for source in train],
        [(source.spec, _source_path(source)) for source in held_out],
    )


def check_held_out_apart(train: Sequence[tuple[str, Path | None]], held_out: Sequence[tuple[str, Path | None]]) -> None:
    """Refuse (TokenDataError) a held-out source that is, holds or lies inside a training source,
    or is a file with the same contents as a training file (a copy): its documents would be
    trained on and held out at once. Each source is (spec, the file or folder it reads, or None)."""
    for val_spec, val_path in held_out:
        a = Path(val_path).resolve() if val_path is not None else None
        for spec, path in train:
            b = Path(path).resolve() if path is not None else None
            same = val_spec == spec or (
                a is not None and b is not None and (a == b or a.is_relative_to(b) or b.is_relative_to(a))
            )
            copy = (
                not same
                and a is not None
                and b is not None
                and a.is_file()
                and b.is_file()
                and a.stat().st_size == b.stat().st_size
                and sha256_file(a) == sha256_file(b)
            )
            if same or copy:
                how = "holds the same contents as" if copy else "overlaps"
                raise TokenDataError(
                    f"the held-out source {val_spec} {how} the training source {spec}; "
                    "pass held-out documents that are not among the training ones"
                )


def write_dataset_directory(
    out: Path,
    fill: Callable[[Path], None],
    extra_files: Sequence[str] = (),
    overwrite: bool = False,
    what: str = "a dataset prepare",
) -> None:
    """Call fill(scratch) to write a dataset's files into a scratch folder, then put them in place
    at `out`: a new `out` is the scratch folder renamed; into an existing one (a dataset to
    replace) the files are renamed in with meta.json last (`extra_files`: names beyond the token
    files, e.g. the loss masks of supervised examples). A failure or Ctrl-C leaves `out` as it was.
    An `out` holding anything but a dataset is refused unless `overwrite`
    (`farsight.files.claim_output_folder`), and `out` is locked while it is written
    (`farsight.files.folder_lock`, the owner named as `what`): a second writer is refused."""
    with writing_folder(out, "dataset", what, overwrite, fix="prepare into another folder"):
        if not out.exists():
            atomic_directory(out, fill)
        else:
            scratch = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
            try:
                fill(scratch)
                _commit(scratch, out, extra_files)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)


def _write_dataset(
    scratch: Path,
    sources: list[Source],
    tok: Tokenizer,
    dtype: np.dtype,
    val_fraction: float,
    seed: int,
    append_eos: bool,
    progress: bool,
    fixed: Sequence[str] = (),
) -> dict[str, Any]:
    """Every file of a prepared dataset, written into the folder `scratch`; returns meta.json's dict.
    fixed: per source, the split all its documents go to (empty: every document by its hash)."""
    counts = [
        {"documents": 0, "train_documents": 0, "val_documents": 0, "train_tokens": 0, "val_tokens": 0} for _ in sources
    ]
    with open(scratch / "train.bin", "wb") as train_handle, open(scratch / "val.bin", "wb") as val_handle:
        writers = {"train": _SplitWriter(train_handle), "val": _SplitWriter(val_handle)}
        splitter = _HeldBackSplitter(writers, counts, val_fraction, fixed)
        _tokenize_sources(sources, tok, dtype, seed, append_eos, progress, splitter, counts)
        splitter.finish()
        for handle in (train_handle, val_handle):
            handle.flush()
            os.fsync(handle.fileno())
    total_documents = sum(c["documents"] for c in counts)
    if total_documents < 2:
        raise TokenDataError(
            f"the sources hold {total_documents} document(s); a split by document needs at least 2 (add documents or sources)"
        )
    checksums = {f"{split}.bin": writers[split].digest.hexdigest() for split in SPLITS}
    for split in SPLITS:
        with open(scratch / f"{split}.docs.npy", "wb") as handle:
            np.save(handle, np.asarray(writers[split].starts, dtype=np.int64))
        checksums[f"{split}.docs.npy"] = sha256_file(scratch / f"{split}.docs.npy")
    meta = _build_meta(sources, counts, writers, tok, dtype, None if fixed else val_fraction, seed, append_eos)
    if fixed:
        meta["val_sources"] = [source.spec for source, split in zip(sources, fixed) if split == "val"]
    meta["checksums"] = dict(sorted(checksums.items()))
    tok.save(scratch)
    (scratch / META_FILENAME).write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
    return meta


def _tokenize_sources(
    sources: list[Source],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    seed: int,
    append_eos: bool,
    progress: bool,
    splitter: _HeldBackSplitter,
    counts: list[dict[str, int]],
) -> None:
    eos = np.asarray([tokenizer.eos_id] if append_eos else [], dtype=dtype)
    total_tokens = 0
    with progress_bar(desc="tokenizing", unit=" docs", disable=not progress, dynamic_ncols=True) as bar:

        def flush(batch: list[Document], source_index: int) -> None:
            nonlocal total_tokens
            for document, ids in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
                array = np.concatenate([np.asarray(ids, dtype=dtype), eos])
                splitter.add(_Pending(array, split_score(document.doc_id, seed), source_index))
                total_tokens += len(array)
            bar.set_postfix(tokens=f"{total_tokens:,}", refresh=False)
            bar.update(len(batch))

        for index, source in enumerate(sources):
            bar.set_description_str(f"tokenizing {source.spec}")
            batch: list[Document] = []
            characters, text_in_source = 0, 0
            for document in source:
                batch.append(document)
                characters += len(document.text)
                text_in_source += len(document.text)
                counts[index]["documents"] += 1
                if len(batch) >= _BATCH_DOCUMENTS or characters >= _BATCH_CHARACTERS:
                    flush(batch, index)
                    batch, characters = [], 0
            if batch:
                flush(batch, index)
            if counts[index]["documents"] == 0:
                raise TokenDataError(
                    f"source {source.spec!r} produced no documents; check that it points at the data you meant"
                )
            if text_in_source == 0:  # a dataset of end-of-document tokens alone would train on nothing
                raise TokenDataError(
                    f"source {source.spec!r} holds {counts[index]['documents']} document(s), all empty; "
                    "check that it points at the data you meant"
                )


def _build_meta(
    sources: list[Source],
    counts: list[dict[str, int]],
    writers: dict[str, _SplitWriter],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    val_fraction: float | None,
    seed: int,
    append_eos: bool,
) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "farsight_version": _farsight_version(),
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.to_spec(),
        "append_eos": append_eos,
        "val_fraction": val_fraction,
        "seed": seed,
        "splits": {
            split: {
                "tokens": writers[split].tokens,
                "documents": len(writers[split].starts),
                "file": f"{split}.bin",
                "offsets_file": f"{split}.docs.npy",
            }
            for split in SPLITS
        },
        "sources": [{**source.describe(), **count} for source, count in zip(sources, counts)],
    }


def _commit(scratch: Path, out: Path, extra_files: Sequence[str] = ()) -> None:
    # The old meta.json goes first, so while files are swapped the directory reads as "not
    # prepared" rather than as an old meta describing new token files.
    (out / META_FILENAME).unlink(missing_ok=True)
    for split in SPLITS:
        for name in (f"{split}.bin", f"{split}.docs.npy"):
            os.replace(scratch / name, out / name)
        if f"{split}.mask.bin" not in extra_files:  # the loss masks of a supervised dataset replaced
            (out / f"{split}.mask.bin").unlink(missing_ok=True)
    for name in extra_files:
        os.replace(scratch / name, out / name)
    os.replace(scratch / TOKENIZER_FILENAME, out / TOKENIZER_FILENAME)
    os.replace(scratch / META_FILENAME, out / META_FILENAME)


def load_meta(out_dir: str | os.PathLike[str], sft: bool | None = None) -> dict[str, Any]:
    """The meta.json of a prepared dataset, checked: a missing, empty or damaged file, or one that
    lacks a field the token files are read by, is a TokenDataError naming the fix (`sft`: the
    dataset is meant to hold supervised examples, so the fix is `farsight data prepare-sft`)."""
    directory = Path(out_dir)
    if directory.is_file():
        raise TokenDataError(
            f"{directory} is a file; a prepared dataset is its folder: pass {directory.parent}"
            if (directory.parent / META_FILENAME).is_file()
            else f"{directory} is a file, not a prepared dataset; pass the folder `farsight data prepare{'-sft' if sft else ''} --out` wrote"
        )
    if not directory.is_dir():
        raise TokenDataError(
            f"no prepared dataset at {directory} (no such directory); {_prepare_command(directory, bool(sft))}"
        )
    path = directory / META_FILENAME
    if not path.exists():
        if any((directory / f"{split}.bin").exists() for split in SPLITS):
            raise TokenDataError(
                f"{directory} has token files but no {META_FILENAME}: a prepare was interrupted while replacing them; "
                f"{prepare_again(directory, sft)}"
            )
        raise TokenDataError(
            f"no prepared dataset at {directory} ({META_FILENAME} missing); {_prepare_command(directory, bool(sft))}"
        )
    fix = prepare_again(directory, sft)
    meta = read_json(path, fix, TokenDataError)
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise TokenDataError(
            f"{path} describes format {meta.get('format')!r} version {meta.get('format_version')!r}; this farsight reads "
            f"{FORMAT_NAME!r} version {FORMAT_VERSION}; {fix}"
        )
    require_fields(meta, _META_FIELDS, path, fix, TokenDataError)
    if meta["dtype"] not in _TOKEN_DTYPES or meta["vocab_size"] < 1:
        raise refusal(
            path, f"is corrupted (dtype {meta['dtype']!r}, vocab_size {meta['vocab_size']})", fix, TokenDataError
        )
    for split, info in meta["splits"].items():
        where = f"{path} (split {split!r})"
        if not isinstance(info, dict):
            raise refusal(where, "is not a JSON object", fix, TokenDataError)
        require_fields(info, _SPLIT_FIELDS, where, fix, TokenDataError)
        names = [info["file"], info["offsets_file"], info.get("mask_file", "x")]
        if (
            info["tokens"] < 0
            or info["documents"] < 0
            or any(not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..") for n in names)
        ):
            raise refusal(
                where, "is corrupted (it names files outside the dataset, or negative counts)", fix, TokenDataError
            )
    return meta


def dataset_digest(out_dir: str | os.PathLike[str]) -> str:
    """A short hash of what the prepared dataset in `out_dir` holds, cheap on any size: the SHA-256
    of its token files that meta.json records, or, for a dataset prepared before meta.json held
    them, the files' sizes and samples of their bytes (the whole file up to 1 MiB, else 16 spread
    blocks of 64 KiB). Re-preparing the same text with the same tokenizer and split gives the
    same fingerprint; other text gives another."""
    directory = Path(out_dir)
    meta = load_meta(directory)
    basis: dict[str, Any] = {"tokenizer": meta.get("tokenizer"), "dtype": meta.get("dtype")}
    if isinstance(meta.get("checksums"), dict):
        basis["checksums"] = meta["checksums"]
    else:
        names = [info[key] for info in meta.get("splits", {}).values() for key in ("file", "offsets_file")]
        basis["samples"] = {name: _sampled_digest(directory / name) for name in sorted(set(names))}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def _sampled_digest(path: Path, blocks: int = 16, block: int = 1 << 16) -> str:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        if size <= 1 << 20:
            digest.update(handle.read())
        else:
            for i in range(blocks):
                handle.seek((size - block) * i // (blocks - 1))
                digest.update(handle.read(block))
    return digest.hexdigest()


class TokenFile:
    """One split of a prepared dataset, opened read-only as a memmap.

    `tokens[a:b]` (or `token_file[a:b]`) reads ids without loading the file; `documents()`
    gives each document's [start, end) range. Pass `tokenizer` to insist the data was made
    with it, and `vocab_size` (the model's embedding size) to insist every id fits the model.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        split: str = "train",
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        vocab_size: int | None = None,
        sft: bool | None = None,
    ) -> None:
        self.directory = Path(out_dir)
        self.meta = load_meta(self.directory, sft)
        self._fix = prepare_again(self.directory, sft)
        splits = self.meta.get("splits", {})
        if split not in splits:
            raise TokenDataError(f"split {split!r} is not in {self.directory}; available splits: {', '.join(splits)}")
        self.split = split
        info = splits[split]
        self.vocab_size = int(self.meta["vocab_size"])
        self.dtype = np.dtype(self.meta["dtype"])
        self._check_vocab(tokenizer, vocab_size)
        self.tokens = self._open_tokens(self.directory / info["file"], int(info["tokens"]))
        self._starts = self._load_starts(self.directory / info["offsets_file"], int(info["documents"]))
        self._tokenizer: Tokenizer | None = None

    def _check_vocab(self, tokenizer: Tokenizer | str | os.PathLike[str] | None, vocab_size: int | None) -> None:
        where = self.directory / META_FILENAME
        if self.dtype != token_dtype(self.vocab_size):
            raise TokenDataError(
                f"{where}: dtype {self.dtype} does not match vocab_size {self.vocab_size} (expected {token_dtype(self.vocab_size)}); prepare the dataset again"
            )
        spec = self.meta["tokenizer"]
        if spec.get("vocab_size") != self.vocab_size:
            raise TokenDataError(
                f"{where}: vocab_size {self.vocab_size} disagrees with its tokenizer spec ({spec.get('vocab_size')}); prepare the dataset again"
            )
        saved = self.directory / TOKENIZER_FILENAME
        if saved.exists() and read_json(saved, self._fix, TokenDataError) != spec:
            raise TokenDataError(
                f"{saved} differs from the tokenizer recorded in {where}; it was replaced after prepare; {self._fix}"
            )
        if tokenizer is not None:
            expected = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
            if expected.to_spec() != spec:
                raise TokenDataError(
                    f"{self.directory} was prepared with the {spec.get('type')} tokenizer (vocab_size {self.vocab_size}) but the "
                    f"{expected.kind} tokenizer (vocab_size {expected.vocab_size}) was requested; prepare it again with that tokenizer, or use the dataset's"
                )
        if vocab_size is not None and vocab_size < self.vocab_size:
            raise TokenDataError(
                f"model vocab_size {vocab_size} is smaller than the dataset's vocab_size {self.vocab_size} ({self.directory}); set the model's vocab_size to at least {self.vocab_size}"
            )

    def _open_tokens(self, path: Path, count: int) -> np.ndarray:
        if not path.exists():
            raise TokenDataError(f"{path} is missing although {META_FILENAME} lists it; {self._fix}")
        expected_bytes = count * self.dtype.itemsize
        actual_bytes = check_file(path, self._fix, TokenDataError, empty_ok=True)
        if actual_bytes != expected_bytes:
            raise TokenDataError(
                f"{path} holds {actual_bytes} bytes but {META_FILENAME} promises {count} {self.dtype} tokens ({expected_bytes} bytes); {self._fix}"
            )
        if count == 0:
            # mmap cannot map an empty file.
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(count,))

    def _load_starts(self, path: Path, count: int) -> np.ndarray:
        if not path.exists():
            raise TokenDataError(f"{path} is missing although {META_FILENAME} lists it; {self._fix}")
        starts = load_npy(path, self._fix, TokenDataError)
        valid = (
            starts.dtype.kind in "iu"
            and starts.ndim == 1
            and len(starts) == count
            and (
                count == 0 or (starts[0] == 0 and bool(np.all(np.diff(starts) >= 0)) and starts[-1] <= len(self.tokens))
            )
        )
        if not valid:
            raise TokenDataError(
                f"{path} does not hold {count} increasing document offsets within {len(self.tokens)} tokens; {self._fix}"
            )
        return starts.astype(np.int64, copy=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: Any) -> Any:
        return self.tokens[index]

    @property
    def num_documents(self) -> int:
        return len(self._starts)

    def documents(self) -> np.ndarray:
        """Shape (num_documents, 2): each document's [start, end) token range, eos included."""
        ends = np.append(self._starts[1:], len(self.tokens)).astype(np.int64)
        return np.stack([self._starts, ends], axis=1)

    def document(self, index: int) -> np.ndarray:
        """The ids of document `index` (a memmap view)."""
        start = int(self._starts[index])
        position = range(self.num_documents)[index]
        end = int(self._starts[position + 1]) if position + 1 < self.num_documents else len(self.tokens)
        return self.tokens[start:end]

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the dataset was prepared with, rebuilt from meta.json."""
        if self._tokenizer is None:
            self._tokenizer = tokenizer_from_spec(self.meta["tokenizer"])
        return self._tokenizer

    def __repr__(self) -> str:
        return f"TokenFile({str(self.directory)!r}, split={self.split!r}, tokens={len(self)}, documents={self.num_documents}, dtype={self.dtype})"


def load_token_dataset(
    out_dir: str | os.PathLike[str],
    split: str = "train",
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
) -> TokenFile:
    """Open `split` ("train" or "val") of the dataset prepared in `out_dir`; see `TokenFile`."""
    return TokenFile(out_dir, split, tokenizer=tokenizer, vocab_size=vocab_size)
