"""Prompt/completion records for the supervised-data tests, and a JSONL writer."""

import json

import numpy as np


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def pairs(n, seed=0):
    """n prompt/completion records of varied lengths (prompts 5 to ~120 bytes)."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(words, size=int(rng.integers(1, 20)))) + f" #{i}:"
        out.append({"prompt": prompt, "completion": " " + " ".join(rng.choice(words, size=int(rng.integers(1, 4))))})
    return out
