"""farsight's tokenizers (byte, GPT-2 BPE, trained BPE) as a Hugging Face fast tokenizer.

The HF tokenizer wraps a `tokenizers.Tokenizer` with the farsight one's ids, and no special token
added to what it encodes. As in transformers, a special token's text encodes to its id: fine-tuning
tools (TRL's SFTTrainer) end each example with the eos token's text, "<|eos|>", which must become
the eos id, or a fine-tuned model learns to write those seven bytes and never stops.
`from_farsight(tokenizer, split_special_tokens=True)` encodes that text as ordinary text instead,
as farsight's own tokenizers do (their data never holds a special id made from text). A landmark
id made from text is refused by a DRT's forward. `decode(ids)` gives farsight's text for
ordinary tokens; `skip_special_tokens=True` drops pad, bos, eos and the landmark.

A farsight model directory keeps its tokenizer as farsight's spec in tokenizer.json (not a
`tokenizers` file); `FarsightTokenizerFast.from_pretrained` reads that spec and `save_pretrained`
writes it back, so the directory stays loadable by farsight.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from farsight.data.tokenizers import TOKENIZER_FILENAME, ByteTokenizer, Tokenizer, load_tokenizer
from farsight.models import CONFIG_FILE, resolve_model_dir
from farsight.models.registry import load_model_tokenizer

# what `from_pretrained` receives from the Auto classes and the Hub API; a local spec needs none
_HUB_KWARGS = (
    "_from_auto",
    "_commit_hash",
    "revision",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "token",
    "subfolder",
    "trust_remote_code",
    "code_revision",
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of tokenizers' ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_backend(tokenizer: ByteTokenizer) -> tokenizers.Tokenizer:
    """Bytes as ids 0..255 (a BPE without merges over the byte alphabet), then the special tokens."""
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    names = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)  # pad, bos, eos, lmk: ids 256..259
    backend.add_special_tokens([AddedToken(_byte_special_text(name), special=True) for name in names])
    return backend


def _byte_special_text(name: str) -> str:
    # bos/eos decode as farsight's ByteTokenizer writes them; pad/lmk get the same pattern
    return ByteTokenizer._TEXT.get(name, f"<|{name}|>")


def backend_of(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` with the ids of the farsight `tokenizer` (a copy: changing it
    leaves the farsight tokenizer as it is)."""
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_backend(tokenizer)
    # the GPT-2 and trained BPE tokenizers are `tokenizers` pipelines already
    return tokenizer.backend_copy()


class FarsightTokenizerFast(PreTrainedTokenizerFast):
    """A farsight tokenizer as a `PreTrainedTokenizerFast`; `farsight_tokenizer` is the original."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, *args: Any, farsight_tokenizer: Tokenizer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.farsight_tokenizer = farsight_tokenizer

    @classmethod
    def from_farsight(cls, tokenizer: Tokenizer, **kwargs: Any) -> FarsightTokenizerFast:
        """The HF tokenizer of a farsight tokenizer; kwargs go to PreTrainedTokenizerFast (e.g.
        padding_side; split_special_tokens=True encodes special tokens' text as text)."""
        backend = backend_of(tokenizer)
        text = {name: backend.id_to_token(tokenizer.special_tokens[name]) for name in ("pad", "bos", "eos", "lmk")}
        kwargs.setdefault("split_special_tokens", False)  # "<|eos|>" in text is the eos id, as in transformers
        # a decoder-only model continues a row after its last token: batches for `generate` pad on
        # the left, as other decoder-only models' tokenizer configs set (forward takes either side)
        kwargs.setdefault("padding_side", "left")
        return cls(
            tokenizer_object=backend,
            farsight_tokenizer=tokenizer,
            bos_token=text["bos"],
            eos_token=text["eos"],
            pad_token=text["pad"],
            extra_special_tokens=[text["lmk"]],
            clean_up_tokenization_spaces=False,
            **kwargs,
        )

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> FarsightTokenizerFast:
        """The tokenizer of a farsight model directory (its tokenizer.json spec), a training run,
        a tokenizer.json file, or a built-in name ("byte", "gpt2")."""
        for name in _HUB_KWARGS:
            kwargs.pop(name, None)
        source = pretrained_model_name_or_path
        if Path(source).is_dir() and not (Path(source) / TOKENIZER_FILENAME).is_file():
            source = resolve_model_dir(source)  # a training run: its newest checkpoint's tokenizer
        if Path(source).is_dir() and (Path(source) / CONFIG_FILE).is_file():
            return cls.from_farsight(load_model_tokenizer(source), **kwargs)  # checked against the model's vocabulary
        return cls.from_farsight(load_tokenizer(source), **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> tuple[str, ...]:
        """Write farsight's tokenizer.json spec (what farsight's loader and `from_pretrained` read)."""
        if self.farsight_tokenizer is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        return (str(self.farsight_tokenizer.save(save_directory)),)
