"""Model directories on disk: config.json (model type + config), model.safetensors (and the
tokenizer's file), written atomically, with checksums.json recording the size and SHA-256 of each,
and read with checks; a training run directory resolves to its newest checkpoint.

Loading verifies every file checksums.json lists and refuses one that differs (flipped bytes, an
edited config, a missing file). A directory without checksums.json (written by farsight before
it existed) still loads, with a logged note, since nothing can be verified.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farsight.errors import InputError, InputTypeError, MissingFileError, ModelFileError
from farsight.files import atomic_write, os_error_of, sha256_file
from farsight.readers import read_json, require_fields

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CHECKSUMS_FILE = "checksums.json"
# The one Python file a model directory carries: what transformers imports for
# `trust_remote_code=True` (config.json's "auto_map" names its classes). It only imports the
# installed farsight package's classes; loading refuses a directory whose copy differs from HF_SHIM.
HF_SHIM_FILE = "farsight_hf.py"
HF_SHIM = '''"""A farsight model directory: transformers imports this file for trust_remote_code=True, and it
only imports the classes of the installed farsight package (the directory holds no model code)."""

try:
    from farsight.hf import (
        FarsightDRTConfig,
        FarsightDRTForCausalLM,
        FarsightTokenizerFast,
        FarsightTransformerConfig,
        FarsightTransformerForCausalLM,
    )
except ImportError as exc:
    raise ImportError(f"this model needs the farsight package: pip install 'farsight[hf]' ({exc})") from None

__all__ = [
    "FarsightDRTConfig",
    "FarsightDRTForCausalLM",
    "FarsightTokenizerFast",
    "FarsightTransformerConfig",
    "FarsightTransformerForCausalLM",
]
'''
# the stem of farsight.hf's config and model class names of each model type (what auto_map names)
_HF_CLASS_STEMS = {"drt": "FarsightDRT", "transformer": "FarsightTransformer"}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """safetensors' save_file; a write that fails (a full disk) raises the OSError it is, which
    safetensors reports as a SafetensorError naming the OS error only in its message."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as exc:
        error = os_error_of(exc, path)
        if error is None:
            raise
        raise error from exc


def write_model_dir(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """config.json from `meta` with the entries transformers reads (`hf_entries`),
    model.safetensors from `tensors` (moved to the CPU, contiguous), and the HF_SHIM_FILE."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    stored = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    write_config(path, {**meta, **hf_entries(meta["model_type"], stored)})
    atomic_write(path / WEIGHTS_FILE, lambda tmp: save_tensors(tensors, tmp))
    write_hf_shim(path)


def write_config(path: Path, meta: dict[str, Any]) -> None:
    """config.json of directory `path` from `meta`, atomically."""
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


def write_hf_shim(path: Path) -> None:
    """The HF_SHIM_FILE of directory `path`, atomically."""
    atomic_write(path / HF_SHIM_FILE, lambda tmp: Path(tmp).write_text(HF_SHIM))


def hf_entries(model_type: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """The config.json entries transformers reads: "auto_map" (the classes of the HF_SHIM_FILE,
    which `trust_remote_code=True` loads) and "dtype", the stored weights' (what `dtype="auto"`
    loads them in; transformers' name, e.g. "bfloat16"), when known."""
    entries: dict[str, Any] = {}
    stem = _HF_CLASS_STEMS.get(model_type)
    if stem is not None:
        module = HF_SHIM_FILE.removesuffix(".py")
        entries["auto_map"] = {
            "AutoConfig": f"{module}.{stem}Config",
            "AutoModelForCausalLM": f"{module}.{stem}ForCausalLM",
            "AutoTokenizer": [None, f"{module}.FarsightTokenizerFast"],
        }
    if dtype is not None:
        entries["dtype"] = str(dtype).removeprefix("torch.")
    return entries


def stored_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The dtype of the first floating-point tensor of the model.safetensors of directory `path`,
    read from the file's header (no tensor is loaded); None if it holds none or is unreadable."""
    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    try:
        with open(Path(path) / WEIGHTS_FILE, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return None
    return next((names[e["dtype"]] for e in header.values() if isinstance(e, dict) and e.get("dtype") in names), None)


def cast_weights(source: Path, out: Path, dtype: torch.dtype) -> None:
    """Copy a model.safetensors with its floating-point tensors cast to `dtype` (loading casts them
    back to the model's dtype), written atomically."""
    from safetensors.torch import load_file

    tensors = load_file(source)
    largest = torch.finfo(dtype).max
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel() and float(tensor.abs().max()) > largest:
            raise InputError(
                f"weight {name!r} holds values up to {float(tensor.abs().max()):.4g}, beyond {dtype}'s largest {largest:.4g}; export in bf16 or fp32"
            )
    tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    atomic_write(out, lambda tmp: save_tensors(tensors, tmp))


def write_checksums(path: Path, names: Iterable[str], extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Record the size and SHA-256 of the files `names` of directory `path` in checksums.json
    (those that exist), atomically: {"files": {name: {"bytes": n, "sha256": hex}}, **extra};
    returns the entries."""
    files = {
        name: {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
        for name in sorted(names)
        if (path / name).is_file()
    }
    text = json.dumps({"files": files, **(extra or {})}, indent=2) + "\n"
    atomic_write(path / CHECKSUMS_FILE, lambda tmp: Path(tmp).write_text(text))
    return files


def read_checksums(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files checksums.json of directory `path` lists, or None (with a logged warning) without one."""
    record = path / CHECKSUMS_FILE
    if not record.exists():
        logger.warning(
            f"note: {path} has no {CHECKSUMS_FILE} (written by an older farsight); its files cannot be verified — "
            "re-save it with save_pretrained to add one"
        )
        return None
    fix = "restore the directory from a good copy or re-save the model"
    data = read_json(record, fix, ModelFileError)
    require_fields(data, {"files": dict}, record, fix, ModelFileError)
    files = data["files"]
    valid = all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in files.values()
    )
    if not valid:
        raise ModelFileError(f"{record} is corrupted (an entry lacks bytes/sha256); {fix}")
    return files


def verify_model_dir(path: Path) -> dict[str, dict[str, Any]] | None:
    """Refuse (ModelFileError) a model directory whose files differ from its checksums.json;
    returns the verified entries (None for a directory without the record)."""
    files = read_checksums(path)
    shim = path / HF_SHIM_FILE
    if shim.is_file() and shim.read_bytes() != HF_SHIM.encode():
        raise ModelFileError(
            f"{shim} is not the file farsight writes (a model directory carries no code of its own); "
            "restore the directory from a good copy or re-save the model"
        )
    for name, entry in (files or {}).items():
        file = path / name
        if not file.is_file():
            raise ModelFileError(
                f"{file} is missing but {CHECKSUMS_FILE} lists it; the directory is incomplete — restore it or re-save the model"
            )
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise ModelFileError(
                f"{file} has {size} bytes, {CHECKSUMS_FILE} says {entry['bytes']}: truncated or corrupted (or edited); "
                "restore it or use another checkpoint"
            )
        if sha256_file(file) != entry["sha256"]:
            raise ModelFileError(
                f"{file} does not match its SHA-256 in {CHECKSUMS_FILE}: corrupted or edited; "
                "restore it or use another checkpoint"
            )
    return files


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model directory, or a training run directory (its newest checkpoint)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"a model is named by its directory's path (str or Path), got {type(path).__name__} {path!r}"
        )
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return path
    checkpoints = sorted((path / "checkpoints").glob("step_*[0-9]")) if path.is_dir() else []
    if checkpoints:
        return checkpoints[-1]
    what = "does not exist" if not path.exists() else "is a file" if path.is_file() else "holds neither"
    raise MissingFileError(
        f"{path} is neither a model directory (with {CONFIG_FILE}) nor a training run with checkpoints ({what}); "
        "pass a folder written by `farsight export` or save_pretrained, or a run of `farsight train`"
    )


# checksums.json's entry, in an exported directory, for the SHA-256 of the weights file it copies
# as training wrote it (before any cast): every export of one checkpoint records the same value, so
# a result measured on one copy is known to hold for another (`trained_weights`)
TRAINED_WEIGHTS_KEY = "trained_weights"


def trained_weights(path: str | os.PathLike) -> str | None:
    """The SHA-256 of the weights file, as training wrote it, that the model directory (or the
    run's newest checkpoint) `path` holds or copies: the entry an export recorded, else its own
    model.safetensors' (as checksums.json lists it, or hashed here). None where `path` is no
    model directory or holds no weights file; the files are not verified here (loading does)."""
    try:
        directory = resolve_model_dir(path)
    except MissingFileError:
        return None
    record = directory / CHECKSUMS_FILE
    try:
        data = json.loads(record.read_text()) if record.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = {}
    if isinstance(data, dict):
        if isinstance(data.get(TRAINED_WEIGHTS_KEY), str):
            return data[TRAINED_WEIGHTS_KEY]
        entry = data.get("files", {}).get(WEIGHTS_FILE) if isinstance(data.get("files"), dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    return sha256_file(directory / WEIGHTS_FILE) if (directory / WEIGHTS_FILE).is_file() else None


def check_tokenizer_fits(path: str | os.PathLike, tokenizer_vocab: int, model_vocab: int | None = None) -> None:
    """Refuse (ModelFileError) a tokenizer with more tokens than the model of directory `path` has
    embeddings for (`model_vocab`, read from its config.json when not given): its extra ids would
    index past the model's vocabulary, and what the model writes would decode as another text."""
    if model_vocab is None:
        model_vocab = read_model_meta(path)["config"].get("vocab_size")
    if isinstance(model_vocab, int) and tokenizer_vocab > model_vocab:
        raise ModelFileError(
            f"{Path(path) / 'tokenizer.json'} has {tokenizer_vocab:,} tokens but the model in {path} has a vocabulary "
            f"of {model_vocab:,}: the tokenizer belongs to another model; put back the model's own tokenizer.json "
            "(or export the model again from its training run)"
        )


def read_model_meta(path: str | os.PathLike, known_types: Iterable[str] | None = None) -> dict:
    """The parsed config.json of a model directory; its model_type must be in `known_types` (if given)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.exists():
        raise MissingFileError(f"no {CONFIG_FILE} in {path}; is it a directory written by save_pretrained?")
    fix = "restore the directory from a good copy or use another checkpoint"
    meta = read_json(config_path, fix, ModelFileError)
    if "model_type" not in meta or "config" not in meta:
        raise ModelFileError(f"{config_path} lacks 'model_type'/'config'; it was not written by farsight")
    require_fields(meta, {"model_type": str, "config": dict}, config_path, fix, ModelFileError)
    if known_types is not None and meta["model_type"] not in known_types:
        raise ModelFileError(f"{config_path}: unknown model_type {meta['model_type']!r}; known: {sorted(known_types)}")
    return meta


def checked_device(device: str | torch.device, name: str) -> torch.device:
    """`device` as a torch.device that this machine has; InputError naming `name` otherwise."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"{name}={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{name}={str(device)!r} but this machine has no CUDA GPU; use 'cpu'")
    return device


def shape_mismatches(model: nn.Module, weights: Path) -> list[str]:
    """The tensors of `model` whose shapes differ from those the safetensors file `weights` stores
    under the same name, as "NAME is [shape] there, [shape] here" (the file's header is read, not
    its tensors)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as stored:
        shapes = {name: list(stored.get_slice(name).get_shape()) for name in stored.keys()}
    return [
        f"{name} is {shapes[name]} there, {list(tensor.shape)} here"
        for name, tensor in model.state_dict().items()
        if name in shapes and shapes[name] != list(tensor.shape)
    ]


def load_weights(model: nn.Module, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> None:
    """Load the model.safetensors of directory `path` into `model`; every tensor must match."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    device = checked_device(map_location, "map_location")
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise MissingFileError(f"{weights} is missing; the checkpoint directory is incomplete")
    try:
        mismatches = shape_mismatches(model, weights)
        if mismatches:
            more = f", and {len(mismatches) - 1} more" if len(mismatches) > 1 else ""
            raise ModelFileError(
                f"{weights} holds tensors of other shapes than this model ({mismatches[0]}{more}); "
                "it has another architecture or vocabulary: build the model from the directory's config.json"
            )
        missing, unexpected = load_model(model, weights, strict=False, device=str(device))
    except (RuntimeError, SafetensorError, OSError) as exc:
        raise ModelFileError(f"{weights} is truncated or corrupted ({exc}); re-save or use another checkpoint") from exc
    if missing or unexpected:
        raise ModelFileError(
            f"{weights} does not match this model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelFileError(
                f"{weights}: tensor {name!r} holds NaN or inf values; the training run diverged — use an earlier checkpoint"
            )
