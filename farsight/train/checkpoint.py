"""Training checkpoints: a loadable model directory plus the trainer state, written atomically.

Layout: OUT/checkpoints/step_00001200/ holding config.json + model.safetensors (a model directory
that `load_model` opens), tokenizer.json, the trainer state (optimizer, scheduler, grad scaler,
RNG states, step, precision, config) as trainer_state.json + trainer_state.safetensors, and
manifest.json (size and SHA-256 of every file). Nothing in a checkpoint is a pickle: a run
directory someone hands you is read as JSON and safetensors, which cannot run code.

The directory is written as step_XXXX.tmp and renamed into place, and an old checkpoint is
renamed to step_XXXX.deleting before it is removed, so a crash never leaves a half-written or
half-deleted checkpoint under a final name; the manifest catches later truncation or corruption.
A write that fails (a full disk) removes its temporary directory and leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from farsight.errors import FarsightError
from farsight.files import atomic_write, sha256_file
from farsight.readers import read_json, require_fields

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
# what a resume reads from the trainer state, and the type each must have
STATE_FIELDS = {"step": int, "tokens_seen": int, "config": dict, "optimizer": dict, "scheduler": dict, "rng": dict}
# the files of a checkpoint, any of which marks a step_N folder as farsight's
FARSIGHT_CHECKPOINT_FILES = ("config.json", "model.safetensors", STATE_JSON, STATE_TENSORS, MANIFEST_FILE)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_\d{8}\.(tmp|deleting)$")


class CheckpointError(FarsightError, RuntimeError):
    """A checkpoint is missing, truncated, corrupted or cannot be written; the message says which and what to do."""


def write_error(path: Path, exc: OSError) -> CheckpointError:
    """The one-line error for a failed write under `path` (a full disk, a read-only directory...)."""
    if exc.errno == errno.ENOSPC:
        return CheckpointError(
            f"disk full at {path} ({exc.strerror}); free some space and run the same command to resume"
        )
    return CheckpointError(
        f"cannot write {path} ({exc.strerror or exc}); check the permissions and space of that directory"
    )


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` (flushed to disk first): a crash or a full disk leaves the old file whole."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    try:
        atomic_write(path, write)
    except OSError as exc:
        raise write_error(path, exc) from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    """N for a checkpoint directory `.../checkpoints/step_N`, else None."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match and path.parent.name == "checkpoints" else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first (temporary directories are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def _remove(path: Path) -> None:
    """Take `path` out of the final names at once (a rename), then delete it."""
    doomed = path.with_name(path.name + ".deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---- trainer state: nested dicts/lists/tuples of plain values and tensors <-> JSON + safetensors ----


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint's trainer state")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.array(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _write_state(directory: Path, state: dict[str, Any]) -> None:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors)
    # serialised in memory and written by Python, so that a failed write raises OSError
    (directory / STATE_TENSORS).write_bytes(save(tensors))
    (directory / STATE_JSON).write_text(json.dumps(encoded))


def _check_tensor_files(directory: Path) -> None:
    """safetensors' save_file can lose a failed write silently; a short file fails to open."""
    from safetensors import SafetensorError, safe_open

    for file in directory.glob("*.safetensors"):
        try:
            with safe_open(str(file), "pt"):
                pass
        except SafetensorError as exc:
            raise OSError(errno.ENOSPC, f"{file.name} came out incomplete ({exc})") from exc


def _clean_leftovers(root: Path) -> None:
    """Temporary directories of writes and deletions that a crash interrupted."""
    for p in root.iterdir():
        if _LEFTOVER.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    root: Path,
    step: int,
    write_model: Callable[[Path], None],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a checkpoint for `step` atomically and delete all but the newest `keep_last`.

    A failed write (e.g. a full disk) removes the partial directory and raises CheckpointError;
    the checkpoints already there stay as they were."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(root)
    except OSError as exc:
        raise write_error(root, exc) from exc
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        tmp.mkdir()
        write_model(tmp)
        _write_state(tmp, state)
        _check_tensor_files(tmp)
        manifest = {
            p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir()) if p.is_file()
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    except BaseException as exc:  # a full disk, or a second Ctrl-C: the previous checkpoint stays the newest
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, FarsightError):
            raise write_error(tmp, exc) from exc
        raise
    if final.exists():
        _remove(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in list_checkpoints(root)[:-keep_last]:
        _remove(old)
    return final


def remove_checkpoints(root: Path) -> list[str]:
    """Delete what farsight wrote under `root` (a run's checkpoints folder): its step_N checkpoints
    (folders of that name holding a checkpoint's files, or nothing) and the step_N.tmp /
    step_N.deleting leftovers of interrupted writes; anything else there (a user's own files)
    stays. Returns the names left, sorted; `root` goes too if nothing is."""
    for p in sorted(root.iterdir()):
        if not p.is_dir() or p.is_symlink():
            continue
        ours = _STEP_DIR.match(p.name) and (
            not any(p.iterdir())
            or any((p / name).is_file() for name in (*FARSIGHT_CHECKPOINT_FILES, LEGACY_STATE_FILE))
        )
        if ours or _LEFTOVER.match(p.name):
            shutil.rmtree(p)
    left = sorted(p.name for p in root.iterdir())
    if not left:
        root.rmdir()
    return left


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file matches the manifest."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.exists():
        raise CheckpointError(
            f"{path} has no {MANIFEST_FILE}; it is incomplete — delete it to resume from an earlier checkpoint"
        )
    fix = f"delete {path} to resume from an earlier checkpoint"
    record = read_json(manifest_path, fix, CheckpointError)
    require_fields(record, {"files": dict}, manifest_path, fix, CheckpointError)
    manifest = record["files"]
    for name, entry in manifest.items():
        if not isinstance(entry, dict) or Path(name).name != name:
            raise CheckpointError(f"{manifest_path} is corrupted (its entry {name!r}); {fix}")
        require_fields(entry, {"bytes": int, "sha256": str}, manifest_path, fix, CheckpointError)
        file = path / name
        problem = None
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != entry["bytes"]:
            problem = f"has {file.stat().st_size} bytes, expected {entry['bytes']} (truncated?)"
        elif sha256_file(file) != entry["sha256"]:
            problem = "does not match its checksum (corrupted)"
        if problem:
            raise CheckpointError(
                f"checkpoint file {file} {problem}; delete {path} to resume from an earlier checkpoint"
            )


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, read from JSON and safetensors only (never unpickled)."""
    if not any((path / name).is_file() for name in (*FARSIGHT_CHECKPOINT_FILES, LEGACY_STATE_FILE)):
        held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        what = f"only {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}" if held else "nothing"
        raise CheckpointError(
            f"{path} is not a farsight checkpoint (it holds {what}, none of config.json, model.safetensors, "
            f"{STATE_JSON}); move it out of {path.parent} to resume from the checkpoint before it, or start over with --restart"
        )
    if not any((path / name).is_file() for name in (STATE_JSON, STATE_TENSORS, LEGACY_STATE_FILE)):
        # shipped runs keep their weights only: the optimizer state is as large again
        raise CheckpointError(
            f"{path} holds model weights only (no trainer state), so its run cannot be resumed; to train on from these "
            f"weights, start a new run with --set train.init_from={path} and a new train.out_dir"
        )
    if not (path / STATE_JSON).is_file() and (path / LEGACY_STATE_FILE).is_file():
        raise CheckpointError(
            f"{path} holds its trainer state as a pickle ({LEGACY_STATE_FILE}, written by an older farsight), which could run "
            f"code when loaded and is not read; to keep its weights, start a new run with --set train.init_from={path} "
            "and a new train.out_dir, or start over with --restart"
        )
    verify_checkpoint(path)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path / STATE_TENSORS)
        state = _decode(json.loads((path / STATE_JSON).read_text()), tensors)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"cannot read the trainer state in {path} ({exc}); delete {path} to resume from an earlier checkpoint"
        ) from exc
    fix = f"delete {path} to resume from an earlier checkpoint"
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_JSON} is corrupted (not a JSON object); {fix}")
    require_fields(state, STATE_FIELDS, path / STATE_JSON, fix, CheckpointError)
    require_fields(state["config"], {"model": dict}, path / STATE_JSON, fix, CheckpointError)
    step = checkpoint_step(path)
    if step is not None and state["step"] != step:
        raise CheckpointError(
            f"{path / STATE_JSON} records step {state['step']}, not the {step} of its folder's name; {fix}"
        )
    return state
