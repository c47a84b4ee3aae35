"""lm-eval's own niah_multikey_2 with its keys swapped for farsight's (experiments/lm-eval-keys/).

Each item is lm-eval's, built by lm-eval's generator with the same metadata; every distinct key
of an item (its needles', its question's and its answer prefix's) is replaced by a key of one
of farsight's kinds (`farsight.data.tasks.ruler.MAKERS`: words, english or coined), the same new
key at each mention, the values untouched. Scored by lm-eval's own string match. A farsight model
that answers these as often as farsight's grid does has no trouble with lm-eval's wording and
needle layout; one that answers them as seldom as lm-eval's own has no trouble with its keys.
"""

from __future__ import annotations

import re
from functools import partial

import datasets
import numpy as np
from lm_eval.tasks.ruler import niah_utils
from lm_eval.tasks.ruler.common_utils import aggregate_metrics, process_results  # noqa: F401 (the YAMLs name them)

from farsight.data.tasks.ruler import MAKERS

KEY = re.compile(r"special magic numbers? for ([a-z]+-[a-z]+)")


def _swapped(doc: dict, kind: str, seed: int) -> dict:
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


def _niah_multikey_2(kind: str, **kwargs) -> dict[str, datasets.Dataset]:
    docs = niah_utils.niah_multikey_2(**kwargs)["test"]
    return {"test": datasets.Dataset.from_list([_swapped(doc, kind, i) for i, doc in enumerate(docs)])}


niah_multikey_2_words = partial(_niah_multikey_2, "words")
niah_multikey_2_english = partial(_niah_multikey_2, "english")
niah_multikey_2_coined = partial(_niah_multikey_2, "coined")
