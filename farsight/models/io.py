"""Model directories on disk: config.json (model type + config) and model.safetensors, written
atomically and read with checks; a training run directory resolves to its newest checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farsight.errors import MissingFileError, ModelFileError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`: a failed
    write leaves the old file as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_model_dir(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json from `meta`, model.safetensors from `tensors` (moved to the CPU, contiguous)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))
    atomic_write(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model directory, or a training run directory (its newest checkpoint)."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return path
    checkpoints = sorted((path / "checkpoints").glob("step_*[0-9]")) if path.is_dir() else []
    if checkpoints:
        return checkpoints[-1]
    raise MissingFileError(f"{path} is neither a model directory (with {CONFIG_FILE}) nor a training run with checkpoints")


def read_model_meta(path: str | os.PathLike, known_types: Iterable[str] | None = None) -> dict:
    """The parsed config.json of a model directory; its model_type must be in `known_types` (if given)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise MissingFileError(f"no {CONFIG_FILE} in {path}; is it a directory written by save_pretrained?")
    try:
        meta = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{config_path} is not valid JSON ({exc}); the checkpoint is corrupted") from exc
    if not isinstance(meta, dict) or "model_type" not in meta or "config" not in meta:
        raise ModelFileError(f"{config_path} lacks 'model_type'/'config'; it was not written by farsight")
    if known_types is not None and meta["model_type"] not in known_types:
        raise ModelFileError(f"{config_path}: unknown model_type {meta['model_type']!r}; known: {sorted(known_types)}")
    return meta


def load_weights(model: nn.Module, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> None:
    """Load the model.safetensors of directory `path` into `model`; every tensor must match."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise MissingFileError(f"{weights} is missing; the checkpoint directory is incomplete")
    try:
        missing, unexpected = load_model(model, weights, strict=False, device=str(map_location))
    except RuntimeError as exc:
        if "size mismatch" in str(exc):
            raise ModelFileError(f"{weights} holds tensors of other shapes than this model ({exc}); it has another architecture") from exc
        raise ModelFileError(f"{weights} is truncated or corrupted ({exc}); re-save or use another checkpoint") from exc
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{weights} is truncated or corrupted ({exc}); re-save or use another checkpoint") from exc
    if missing or unexpected:
        raise ModelFileError(
            f"{weights} does not match this model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
