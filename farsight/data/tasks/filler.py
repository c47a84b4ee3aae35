"""Haystack filler for the needle tasks: real text from a token split, or the classic repeated sentences."""

from __future__ import annotations

from typing import Any

import numpy as np

from farsight.errors import InputError

REPEATED_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


class Filler:
    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n filler token ids (int64)."""
        raise NotImplementedError


class CorpusFiller(Filler):
    """Random windows of a token array (e.g. the validation split of a prepared corpus).

    A request longer than the split is served by several windows from random places, so any
    length (16M tokens and more) works on a small split; the text repeats but not in lockstep.
    """

    def __init__(self, tokens: Any, drop_ids: tuple[int, ...] = ()) -> None:
        self.tokens = tokens
        self.drop = np.asarray(drop_ids, dtype=np.int64)
        if len(tokens) < 2:
            raise InputError("the filler corpus holds fewer than 2 tokens; prepare more text")

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        out = []
        left = n
        total = len(self.tokens)
        while left > 0:
            size = min(left, total)
            start = int(rng.integers(0, total - size + 1))
            window = np.asarray(self.tokens[start : start + size], dtype=np.int64)
            if len(self.drop):
                window = window[~np.isin(window, self.drop)]
            out.append(window)
            left -= len(window)
        return np.concatenate(out)[:n] if out else np.zeros(0, dtype=np.int64)


class RepeatedFiller(Filler):
    """The repeated-sentence haystack of the original passkey test (Mohtashami & Jaggi, 2023),
    RULER's "noise" haystack. Each sentence is encoded on its own with a leading space, so any
    run of them decodes to text that a BPE tokenizer encodes back to the same ids (lengths stay
    exact through lm-eval, which tokenizes text)."""

    def __init__(self, tokenizer: Any, text: str = REPEATED_TEXT) -> None:
        sentences = [" " + s.strip() + "." for s in text.split(".") if s.strip()]
        self.unit = np.concatenate([np.asarray(tokenizer.encode(s), dtype=np.int64) for s in sentences])

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        reps = -(-n // len(self.unit))
        return np.tile(self.unit, reps)[:n]


def make_filler(kind: str, tokenizer: Any, corpus: str | None = None, split: str = "val") -> Filler:
    """kind "corpus" reads `split` of the prepared dataset at `corpus`; "repeat" needs nothing."""
    if kind == "repeat":
        return RepeatedFiller(tokenizer)
    if kind == "corpus":
        if not corpus:
            raise InputError("filler 'corpus' needs a prepared dataset path (farsight data prepare ...)")
        from farsight.data.token_files import load_token_dataset

        data = load_token_dataset(corpus, split)
        if data.tokenizer.to_spec() != tokenizer.to_spec():
            raise InputError(
                f"{corpus} was prepared with another tokenizer than the model's; prepare it with the model's tokenizer"
            )
        specials = tuple(getattr(tokenizer, name) for name in ("eos_id", "bos_id", "pad_id", "lmk_id"))
        return CorpusFiller(data.tokens, drop_ids=specials)
    raise InputError(f"unknown filler {kind!r}; choose 'corpus' or 'repeat'")
