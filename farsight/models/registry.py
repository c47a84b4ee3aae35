"""The table of farsight's model types, and building, loading or exporting a model of any of them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farsight.config import ConfigError
from farsight.data.tokenizers import TOKENIZER_FILENAME
from farsight.errors import InputError, ModelFileError
from farsight.files import atomic_directory
from farsight.models.drt import DRTForCausalLM
from farsight.models.io import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    cast_weights,
    read_model_meta,
    resolve_model_dir,
    write_checksums,
)
from farsight.models.lm import MODEL_DTYPES, PretrainedLM
from farsight.models.transformer import TransformerForCausalLM

MODEL_TYPES: dict[str, type[PretrainedLM]] = {
    TransformerForCausalLM.model_type: TransformerForCausalLM,
    DRTForCausalLM.model_type: DRTForCausalLM,
}


def build_model(spec: dict[str, Any], tokenizer: Any = None) -> PretrainedLM:
    """Model from a config mapping with a `type` key (the `model` section of a training config)."""
    spec = dict(spec)
    model_type = spec.pop("type", None)
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model.type={model_type!r} is unknown; choose one of {sorted(MODEL_TYPES)}")
    cls = MODEL_TYPES[model_type]
    if tokenizer is not None:
        for key, value in cls.config_defaults(tokenizer).items():
            spec.setdefault(key, value)
        if spec["vocab_size"] < tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size={spec['vocab_size']} is smaller than the tokenizer's vocabulary "
                f"({tokenizer.vocab_size}); remove model.vocab_size or set it >= {tokenizer.vocab_size}"
            )
    config = cls.config_class.from_dict(spec, where="model")
    if tokenizer is not None:
        cls.check_tokenizer(config, tokenizer)
    return cls(config)


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> PretrainedLM:
    """Load any farsight model directory (or a training run's newest checkpoint), whatever its type."""
    path = resolve_model_dir(path)
    meta = read_model_meta(path, known_types=MODEL_TYPES)
    return MODEL_TYPES[meta["model_type"]].from_pretrained(path, map_location)


def export_model(
    source: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str | None = None,
    readme: str | Callable[[nn.Module], str] | None = None,
) -> Path:
    """Write the model of `source` (a model directory, or a run's newest checkpoint) to the model
    directory `out`: config, weights (cast to `dtype`, e.g. "bf16", if given), tokenizer, README.md
    (if given: its text, or a function that writes it from the exported model as `load_model` reads
    it back, in eval mode) and a new checksums.json. The copy is built beside `out` and loaded to
    verify it before it replaces `out`, so a failed export leaves `out` as it was; an existing `out`
    must be a model directory or empty. Returns the model directory exported."""
    source, out = resolve_model_dir(source), Path(out)
    load_model(source)  # refuse a damaged source: files against checksums.json, readable and finite weights
    if out.exists() and not (out / CONFIG_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not a model directory; export to a new or empty directory")
    recorded = json.loads((source / CHECKSUMS_FILE).read_text())["files"] if (source / CHECKSUMS_FILE).is_file() else {}
    names = [name for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILENAME) if (source / name).is_file()]

    def fill(staging: Path) -> None:
        for name in names:
            if name == WEIGHTS_FILE and dtype is not None:
                cast_weights(source / name, staging / name, MODEL_DTYPES[dtype])
                recorded.pop(name, None)
            else:
                shutil.copyfile(source / name, staging / name)
        copied = write_checksums(staging, names)
        for name, entry in recorded.items():
            if name in copied and copied[name] != entry:
                raise ModelFileError(
                    f"the copy of {source / name} differs from it; check the disk under {out.parent} and export again"
                )
        exported = load_model(staging)
        if readme is not None:  # not in checksums.json: a card can be rewritten without touching the weights
            (staging / "README.md").write_text(readme(exported.eval()) if callable(readme) else readme)

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_directory(out, fill)
    return source
