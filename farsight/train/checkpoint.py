"""Training checkpoints: a loadable model directory plus the trainer state, written atomically.

Layout: OUT/checkpoints/step_00001200/ holding config.json + model.safetensors (a model directory
that `load_model` opens), tokenizer.json, trainer_state.pt (optimizer, scheduler, RNG states,
step, data position) and manifest.json (size and SHA-256 of every file). The directory is
written as step_XXXX.tmp and renamed into place, so a crash never leaves a half-written
checkpoint under a final name; the manifest catches later truncation or corruption.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from farsight.errors import FarsightError

STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(FarsightError, RuntimeError):
    """A checkpoint is missing, truncated or corrupted; the message says which and what to do."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first (temporary directories are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def save_checkpoint(
    root: Path,
    step: int,
    write_model: Callable[[Path], None],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a checkpoint for `step` atomically and delete all but the newest `keep_last`."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_model(tmp)
    torch.save(state, tmp / STATE_FILE)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file matches the manifest."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST_FILE}; it is incomplete — delete it to resume from an earlier checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupted ({exc}); delete {path} to resume from an earlier checkpoint") from exc
    for name, entry in manifest.items():
        file = path / name
        problem = None
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != entry["bytes"]:
            problem = f"has {file.stat().st_size} bytes, expected {entry['bytes']} (truncated?)"
        elif _sha256(file) != entry["sha256"]:
            problem = "does not match its checksum (corrupted)"
        if problem:
            raise CheckpointError(f"checkpoint file {file} {problem}; delete {path} to resume from an earlier checkpoint")


def load_trainer_state(path: Path) -> dict[str, Any]:
    verify_checkpoint(path)
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for damaged pickles
        raise CheckpointError(f"cannot read {path / STATE_FILE} ({exc}); delete {path} to resume from an earlier checkpoint") from exc
