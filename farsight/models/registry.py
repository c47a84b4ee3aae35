"""The table of farsight's model types, and building, loading or exporting a model of any of them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farsight.config import ConfigError
from farsight.data.tokenizers import TOKENIZER_FILENAME, Tokenizer, load_tokenizer
from farsight.errors import InputError, InputTypeError, ModelFileError
from farsight.files import FOLDER_KINDS, atomic_directory, folder_kind, folder_lock, new_folders_for, reported_write
from farsight.models.drt import DRTForCausalLM
from farsight.models.io import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    HF_SHIM_FILE,
    TRAINED_WEIGHTS_KEY,
    WEIGHTS_FILE,
    cast_weights,
    check_tokenizer_fits,
    hf_entries,
    read_model_meta,
    resolve_model_dir,
    stored_dtype,
    trained_weights,
    write_checksums,
    write_config,
    write_hf_shim,
)
from farsight.models.lm import MODEL_DTYPES, PretrainedLM
from farsight.models.transformer import TransformerForCausalLM

MODEL_TYPES: dict[str, type[PretrainedLM]] = {
    TransformerForCausalLM.model_type: TransformerForCausalLM,
    DRTForCausalLM.model_type: DRTForCausalLM,
}


def build_model(spec: dict[str, Any], tokenizer: Any = None) -> PretrainedLM:
    """Model from a config mapping with a `type` key (the `model` section of a training config)."""
    if not isinstance(spec, Mapping):
        raise InputTypeError(
            f"build_model takes a model section, a mapping with a 'type' key such as {{'type': 'drt', 'd_model': 256}}; "
            f"got {type(spec).__name__} {spec!r}"
        )
    if tokenizer is not None and not hasattr(tokenizer, "vocab_size"):
        raise InputTypeError(
            f"build_model's tokenizer is a tokenizer object, got {type(tokenizer).__name__} {tokenizer!r}; "
            "pass farsight.data.tokenizers.load_tokenizer(...)"
        )
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


def load_model_tokenizer(path: str | os.PathLike, model_vocab: int | None = None) -> Tokenizer:
    """The tokenizer of a model directory (or a run's newest checkpoint), refused (ModelFileError)
    when it has more tokens than the model's vocabulary (`model_vocab`, or its config.json's)."""
    from farsight.readers import check_file

    directory = resolve_model_dir(path)
    fix = "the model directory is incomplete: restore it from a good copy, or export the model again from its run"
    check_file(directory / TOKENIZER_FILENAME, fix, ModelFileError)
    tokenizer = load_tokenizer(directory / TOKENIZER_FILENAME)
    check_tokenizer_fits(directory, tokenizer.vocab_size, model_vocab)
    return tokenizer


# what an export writes, and the mark in its checksums.json that tells a previous export (which
# export may replace) from a model directory written otherwise (replaced only with overwrite=True)
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILENAME, HF_SHIM_FILE, CHECKSUMS_FILE, "README.md"})
EXPORT_MARK = {"written_by": "farsight export"}


def check_export_target(source: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse (InputError) an export of `source` to `out` that would overwrite what it should not:
    the source itself or a folder holding it, a folder inside a run's checkpoints, a training run
    or checkpoint, a file, a folder holding anything an export does not write, and a model
    directory that no export wrote unless `overwrite` (a previous export is replaced)."""
    source, out = resolve_model_dir(source).resolve(), Path(out)
    target = out.resolve()
    if target == source or target in source.parents:
        raise InputError(
            f"{out} is the model being exported{'' if target == source else ' or holds it'}; export to a new folder outside it"
        )
    if source in target.parents:
        raise InputError(f"{out} is inside the model being exported ({source}); export to a new folder outside it")
    for folder in (target, *target.parents):
        if (
            folder.name == "checkpoints"
            and folder.is_dir()
            and any(p.name.startswith("step_") for p in folder.iterdir())
        ):
            raise InputError(
                f"{out} is inside the checkpoints of the run {folder.parent}, where farsight keeps its own files; "
                "export to a new folder outside the run"
            )
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"{out} is a file; export to a new or empty folder")
    held = folder_kind(out)  # what the folder holds, as every command that writes a folder tells it
    if held is None:
        return
    if held in ("run", "checkpoint"):
        raise InputError(f"{out} is a training run or checkpoint; export to a new folder outside the run")
    names = sorted(p.name for p in out.iterdir())
    foreign = [name for name in names if name not in EXPORT_FILES]
    if held != "model" or foreign or CONFIG_FILE not in names:
        if held not in ("model", "other"):
            listed = FOLDER_KINDS[held]
        elif foreign:
            listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        else:
            listed = "no config.json"
        raise InputError(
            f"{out} exists and is not a model directory (it holds {listed}); export to a new or empty folder"
        )
    if not overwrite and not _exported(out):
        raise InputError(
            f"{out} holds a model that no export wrote; pass --force (overwrite=True) to replace it, or export to a new folder"
        )


def _exported(path: Path) -> bool:
    """Whether the model directory `path` was written by an export (its checksums.json says so)."""
    try:
        record = json.loads((path / CHECKSUMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and all(record.get(key) == value for key, value in EXPORT_MARK.items())


def export_model(
    source: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str | None = None,
    readme: str | Callable[[nn.Module], str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model of `source` (a model directory, or a run's newest checkpoint) to the model
    directory `out`: config (with transformers' auto_map and the weights' dtype), weights (cast to
    `dtype`, e.g. "bf16", if given), tokenizer, the HF_SHIM_FILE, README.md (if given: its text,
    or a function that writes it from the exported model as `load_model` reads it back, in eval
    mode) and a new checksums.json. The copy is built beside `out` and loaded to
    verify it before it replaces `out`, so a failed export (a full disk, Ctrl-C) leaves `out` as
    it was and no folder behind; `out` must be new, empty or a previous export (another model
    directory only with `overwrite`), never the source, a run or a checkpoint
    (`check_export_target`). Returns the model directory the copy was made from (a run's newest
    checkpoint for a run), `out` being the caller's."""
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise InputError(
            f"dtype={dtype!r} is not one of {', '.join(MODEL_DTYPES)}; pass one of these names, e.g. 'bf16'"
        )
    if readme is not None and not (isinstance(readme, str) or callable(readme)):
        raise InputTypeError(f"readme must be the card's text or a function of the model, got {type(readme).__name__}")
    check_export_target(source, out, overwrite)
    source, out = resolve_model_dir(source), Path(out)
    model = load_model(source)  # refuse a damaged source: files against checksums.json, readable and finite weights
    if (source / TOKENIZER_FILENAME).is_file():
        load_model_tokenizer(source, model.config.vocab_size)  # a tokenizer of another model is not copied on
    recorded = json.loads((source / CHECKSUMS_FILE).read_text())["files"] if (source / CHECKSUMS_FILE).is_file() else {}
    names = [name for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILENAME) if (source / name).is_file()]
    # config.json gains what transformers reads (auto_map, the stored dtype) if the source lacks it
    meta = read_model_meta(source)
    weights_dtype = MODEL_DTYPES[dtype] if dtype is not None else stored_dtype(source)
    origin = trained_weights(source)  # what every copy of these weights records
    exported_meta = {**meta, **hf_entries(meta["model_type"], weights_dtype)}

    def fill(staging: Path) -> None:
        for name in names:
            if name == WEIGHTS_FILE and dtype is not None:
                cast_weights(source / name, staging / name, MODEL_DTYPES[dtype])
                recorded.pop(name, None)
            elif name == CONFIG_FILE and exported_meta != meta:
                write_config(staging, exported_meta)
                recorded.pop(name, None)
            else:
                shutil.copyfile(source / name, staging / name)
        write_hf_shim(staging)
        copied = write_checksums(staging, [*names, HF_SHIM_FILE], {**EXPORT_MARK, TRAINED_WEIGHTS_KEY: origin})
        for name, entry in recorded.items():
            if name in copied and copied[name] != entry:
                raise ModelFileError(
                    f"the copy of {source / name} differs from it; check the disk under {out.parent} and export again"
                )
        exported = load_model(staging)
        if readme is not None:  # not in checksums.json: a card can be rewritten without touching the weights
            (staging / "README.md").write_text(readme(exported.eval()) if callable(readme) else readme)

    with new_folders_for(out), reported_write(out), folder_lock(out, "farsight export", "export to another folder"):
        check_export_target(source, out, overwrite)  # again, now that no other farsight command writes `out`
        atomic_directory(out, fill)
    return source
