"""What every farsight causal LM shares: output type, loss, sampling, generation loop, save/load."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from farsight.config import ConfigBase, ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPES: dict[str, type[PretrainedLM]] = {}


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
        raise ValueError(f"labels must have shape {list(logits.shape[:2])} (batch, tokens), got {list(labels.shape)}")
    targets = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none")
    valid = (targets != -100).flatten().to(ce.dtype)
    if weights is not None:
        if weights.shape != labels.shape:
            raise ValueError(f"loss weights must have the shape of labels {list(labels.shape)}, got {list(weights.shape)}")
        valid = valid * weights[:, 1:].flatten().to(ce.dtype)
    return (ce * valid).sum() / valid.sum().clamp(min=1e-8)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy decoding."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate_tokens(
    prefill: Callable[[torch.Tensor], torch.Tensor],
    step: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Autoregressive loop over a cached decoder.

    prefill(ids [B, T]) and step(ids [B, 1]) return next-token logits [B, V] and update the
    decoder's caches. Returns [B, T + new] ids; rows that produced eos continue with eos.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    logits = prefill(input_ids)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    new_tokens = []
    for i in range(max_new_tokens):
        token = sample_next_token(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= token == eos_token_id
        new_tokens.append(token)
        if i + 1 == max_new_tokens or bool(finished.all()):
            break
        logits = step(token[:, None])
    if not new_tokens:
        return input_ids
    return torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, forbidden: dict[str, int] | None = None) -> torch.Tensor:
    """Token ids must be a [B, T] (or [T]) integer tensor inside the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError("input_ids must be an integer torch.Tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, tokens], got {list(input_ids.shape)}")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); "
                "was the data tokenized with another tokenizer?"
            )
        for name, token in (forbidden or {}).items():
            if bool((input_ids == token).any()):
                raise ValueError(f"input_ids contain the {name} token id {token}; it is inserted by the model, pass plain text tokens")
    return input_ids.long()


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class PretrainedLM(nn.Module):
    """Save/load as a directory: config.json (model type + config) and model.safetensors."""

    model_type: ClassVar[str]
    config_class: ClassVar[type[ConfigBase]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "model_type" in cls.__dict__:
            MODEL_TYPES[cls.model_type] = cls

    @classmethod
    def config_defaults(cls, tokenizer: Any) -> dict[str, Any]:
        """Config values a tokenizer determines when the config leaves them out."""
        return {"vocab_size": tokenizer.vocab_size}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(
        self, path: str | os.PathLike, tokenizer: Any = None, state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Write config.json, model.safetensors (and tokenizer.json). `state_dict` overrides the
        module's own tensors (e.g. the full state gathered from FSDP shards)."""
        from safetensors.torch import save_file

        import farsight

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"model_type": self.model_type, "farsight_version": farsight.__version__, "config": self.config.to_dict()}
        tensors = dict(state_dict if state_dict is not None else self.state_dict())
        # tied parameters (e.g. embedding and LM head) are stored once, under their first name
        seen: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                tensors.pop(name, None)
            else:
                seen[id(param)] = name
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        _atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))
        _atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        if tokenizer is not None:
            tokenizer.save(path)
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> PretrainedLM:
        path = resolve_model_dir(path)
        meta = read_model_meta(path)
        model_type = meta["model_type"]
        target = MODEL_TYPES[model_type] if cls is PretrainedLM else cls
        if target.model_type != model_type:
            raise ValueError(
                f"{path} holds a {model_type!r} model, not a {target.model_type!r} one; "
                f"load it with {MODEL_TYPES[model_type].__name__}.from_pretrained or farsight.models.load_model"
            )
        config = target.config_class.from_dict(meta["config"], where="config")
        model = target(config)
        load_weights(model, path, map_location)
        return model.to(map_location)


def load_weights(model: PretrainedLM, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> None:
    """Load the model.safetensors of directory `path` into `model`; every tensor must match."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing; the checkpoint directory is incomplete")
    try:
        missing, unexpected = load_model(model, weights, strict=False, device=str(map_location))
    except RuntimeError as exc:
        if "size mismatch" in str(exc):
            raise ValueError(f"{weights} holds tensors of other shapes than this model ({exc}); it has another architecture") from exc
        raise ValueError(f"{weights} is truncated or corrupted ({exc}); re-save or use another checkpoint") from exc
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights} is truncated or corrupted ({exc}); re-save or use another checkpoint") from exc
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not match this model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


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
    return cls(cls.config_class.from_dict(spec, where="model"))


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model directory, or a training run directory (its newest checkpoint)."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return path
    checkpoints = sorted((path / "checkpoints").glob("step_*[0-9]")) if path.is_dir() else []
    if checkpoints:
        return checkpoints[-1]
    raise FileNotFoundError(f"{path} is neither a model directory (with {CONFIG_FILE}) nor a training run with checkpoints")


def read_model_meta(path: Path) -> dict:
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}; is it a directory written by save_pretrained?")
    try:
        meta = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}); the checkpoint is corrupted") from exc
    if not isinstance(meta, dict) or "model_type" not in meta or "config" not in meta:
        raise ValueError(f"{config_path} lacks 'model_type'/'config'; it was not written by farsight")
    if meta["model_type"] not in MODEL_TYPES:
        raise ConfigError(f"{config_path}: unknown model_type {meta['model_type']!r}; known: {sorted(MODEL_TYPES)}")
    return meta


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> PretrainedLM:
    """Load any farsight model directory, whatever its model type."""
    return PretrainedLM.from_pretrained(path, map_location)
