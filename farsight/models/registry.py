"""The table of farsight's model types, and building or loading a model of any of them."""

from __future__ import annotations

import os
from typing import Any

import torch

from farsight.config import ConfigError
from farsight.models.drt import DRTForCausalLM
from farsight.models.io import read_model_meta, resolve_model_dir
from farsight.models.lm import PretrainedLM
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
