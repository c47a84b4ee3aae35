"""lm-eval's own niah_multikey_2 items with one thing changed (experiments/lm-eval-variants/).

Each item is lm-eval's, built by lm-eval's generator with the same metadata, then passed through
a change of its prompt text (`input`) and answer prefix (`gen_prefix`); the answers stay
lm-eval's and are scored by lm-eval's own string match. A model that answers a variant more
often than lm-eval's own items has trouble with what the variant changed.

Keys (niah_multikey_2_words, _english, _coined): every distinct key of an item (its needles',
its question's and its answer prefix's) is replaced by a key of one of farsight's kinds
(`farsight.data.tasks.ruler.MAKERS`), the same new key at each mention, the values untouched.

Layout (niah_multikey_2_spaced, _needle, _spaced_needle): lm-eval's needle haystack puts each
needle on a line of its own, "One of the special magic numbers for KEY is: VALUE.", the lines
joined by newlines. `spaced` runs the needles on like the sentences of a paragraph: every
newline before a needle, the one after the instruction too, becomes a space (farsight's needle
haystack without `lines`, whose instruction does end in a newline); `needle` words each needle "The special
magic number for KEY is: VALUE." (farsight's needle in RULER's wording), still one a line;
`spaced_needle` does both. The instruction, the question and the answer prefix stay lm-eval's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

import datasets
import numpy as np
from lm_eval.tasks.ruler import niah_utils
from lm_eval.tasks.ruler.common_utils import aggregate_metrics, process_results  # noqa: F401 (the YAMLs name them)

from farsight.data.tasks.ruler import MAKERS


def _variant(change: Callable[[dict, int], dict], **kwargs) -> dict[str, datasets.Dataset]:
    """lm-eval's niah_multikey_2 dataset with `change(doc, index)` applied to each item."""
    docs = niah_utils.niah_multikey_2(**kwargs)["test"]
    return {"test": datasets.Dataset.from_list([change(doc, i) for i, doc in enumerate(docs)])}


# -- keys -----------------------------------------------------------------------------------------

KEY = re.compile(r"special magic numbers? for ([a-z]+-[a-z]+)")


def _swapped(kind: str, doc: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    make = MAKERS[kind][0]
    old = list(dict.fromkeys(KEY.findall(doc["input"])))
    new: list[str] = []
    while len(new) < len(old):
        key = make(rng)
        if key not in new and key not in old:
            new.append(key)
    mapping = dict(zip(old, new))

    def swap(text: str) -> str:
        return KEY.sub(lambda m: m.group(0).replace(m.group(1), mapping[m.group(1)]), text)

    return {**doc, "input": swap(doc["input"]), "gen_prefix": swap(doc["gen_prefix"])}


niah_multikey_2_words = partial(_variant, partial(_swapped, "words"))
niah_multikey_2_english = partial(_variant, partial(_swapped, "english"))
niah_multikey_2_coined = partial(_variant, partial(_swapped, "coined"))


# -- layout ---------------------------------------------------------------------------------------

BREAK = re.compile(r"(?<=\.)\n(?=One of the special magic numbers for )")  # before a needle
HEAD = re.compile(r"One of the special magic numbers for (\S+) is: ")


def _laid_out(spaced: bool, needle: bool, doc: dict, index: int) -> dict:
    text = doc["input"]
    if spaced:
        text = BREAK.sub(" ", text)
    if needle:
        text = HEAD.sub(r"The special magic number for \1 is: ", text)
    return {**doc, "input": text}


niah_multikey_2_spaced = partial(_variant, partial(_laid_out, True, False))
niah_multikey_2_needle = partial(_variant, partial(_laid_out, False, True))
niah_multikey_2_spaced_needle = partial(_variant, partial(_laid_out, True, True))
