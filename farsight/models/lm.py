"""What every farsight causal LM shares: output type, loss, input checks, the session and
generate entry points, and save/load of its model directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from farsight.config import ConfigBase
from farsight.data.tokenizers import TOKENIZER_FILENAME
from farsight.errors import InputError, ModelFileError
from farsight.models.io import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_weights,
    read_model_meta,
    resolve_model_dir,
    verify_model_dir,
    write_checksums,
    write_model_dir,
)
from farsight.models.session import Session

MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # what a model can run in


@dataclass
class CausalLMOutput:
    """loss: mean next-token cross-entropy (None without labels); logits [B, T, V] for real tokens."""

    loss: torch.Tensor | None
    logits: torch.Tensor
    retrieval: Any = None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Position t predicts labels[t + 1]; labels of -100 are ignored.

    weights [B, T] (optional) scale each target token's loss (weights[t + 1] for the prediction made
    at t); the loss is the weighted mean, so answer tokens can count more than context tokens.
    """
    if labels.shape != logits.shape[:2]:
        raise InputError(f"labels must have shape {list(logits.shape[:2])} (batch, tokens), got {list(labels.shape)}")
    targets = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none")
    valid = (targets != -100).flatten().to(ce.dtype)
    if weights is not None:
        if weights.shape != labels.shape:
            raise InputError(
                f"loss weights must have the shape of labels {list(labels.shape)}, got {list(weights.shape)}"
            )
        valid = valid * weights[:, 1:].flatten().to(ce.dtype)
    return (ce * valid).sum() / valid.sum().clamp(min=1e-8)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, forbidden: dict[str, int] | None = None) -> torch.Tensor:
    """Token ids must be a [B, T] (or [T]) integer tensor inside the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise InputError("input_ids must be an integer torch.Tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must have shape [batch, tokens], got {list(input_ids.shape)}")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); "
                "was the data tokenized with another tokenizer?"
            )
        for name, token in (forbidden or {}).items():
            if bool((input_ids == token).any()):
                raise InputError(
                    f"input_ids contain the {name} token id {token}; it is inserted by the model, pass plain text tokens"
                )
    return input_ids.long()


class PretrainedLM(nn.Module):
    """Base of farsight's LMs: a config, a forward, a Session for decoding, and a model
    directory (config.json with the model type + config, model.safetensors, checksums.json)."""

    model_type: ClassVar[str]
    config_class: ClassVar[type[ConfigBase]]
    config: Any

    @classmethod
    def config_defaults(cls, tokenizer: Any) -> dict[str, Any]:
        """Config values a tokenizer determines when the config leaves them out."""
        return {"vocab_size": tokenizer.vocab_size}

    @classmethod
    def check_tokenizer(cls, config: Any, tokenizer: Any) -> None:
        """Raise ConfigError if `config` cannot be trained with `tokenizer`'s special tokens."""

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] or [T] token ids -> [B, T] long; refuses ids the model does not take."""
        return check_input_ids(input_ids, self.config.vocab_size, self.reserved_ids())

    def reserved_ids(self) -> dict[str, int]:
        """Ids of the vocabulary the model inserts itself (name -> id; a DRT's landmark): refused
        as input, and never sampled by generation, whose next step would refuse them."""
        return {}

    def new_session(self, batch_size: int = 1, **options: Any) -> Session:
        """A decoding session over this model (farsight.models.session.Session)."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        **session_options: Any,
    ) -> torch.Tensor:
        """Sample continuations of input_ids [B, T] through a fresh session (session_options go
        to `new_session`, e.g. DRT's memory tier); temperature=0 decodes greedily;
        attention_mask [B, T] marks left padding with 0 (models that mask it). Returns [B, T + new]."""
        input_ids = self.check_input_ids(input_ids)
        with self.new_session(input_ids.shape[0], **session_options) as session:
            return session.generate(
                input_ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos_token_id,
                generator=generator,
                attention_mask=attention_mask,
            )

    def save_pretrained(
        self, path: str | os.PathLike, tokenizer: Any = None, state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Write config.json, model.safetensors (and tokenizer.json), then checksums.json with
        their SHA-256. `state_dict` overrides the module's own tensors (e.g. the full state
        gathered from FSDP shards)."""
        import farsight

        path = Path(path)
        meta = {
            "model_type": self.model_type,
            "farsight_version": farsight.__version__,
            "config": self.config.to_dict(),
        }
        tensors = dict(state_dict if state_dict is not None else self.state_dict())
        # tied parameters (e.g. embedding and LM head) are stored once, under their first name
        seen: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                tensors.pop(name, None)
            else:
                seen[id(param)] = name
        write_model_dir(path, meta, tensors)
        if tokenizer is not None:
            tokenizer.save(path)
        write_checksums(path, (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILENAME))
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> PretrainedLM:
        """Load a directory holding a model of this class (any class: farsight.models.load_model),
        refusing files that differ from its checksums.json and weights that are not finite."""
        path = resolve_model_dir(path)
        meta = read_model_meta(path)
        if meta["model_type"] != cls.model_type:
            raise ModelFileError(
                f"{path} holds a {meta['model_type']!r} model, not a {cls.model_type!r} one; "
                "load it with farsight.models.load_model"
            )
        verify_model_dir(path)
        model = cls(cls.config_class.from_dict(meta["config"], where="config"))
        load_weights(model, path, map_location)
        return model.to(map_location)
