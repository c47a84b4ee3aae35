"""File helpers every layer shares: replacing a file atomically, and a file's SHA-256."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path


def _name_beside(path: Path, kind: str) -> str:
    """A fresh hidden name in `path`'s folder (48 random bits: creating it with O_EXCL or mkdir
    cannot meet an existing entry in practice, and would fail rather than overwrite)."""
    return str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.{kind}")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`: a failed
    write leaves the old file as it was. A replaced file keeps its mode; a new one gets what `open`
    would give it (the umask applies, unlike mkstemp's owner-only mode)."""
    tmp = _name_beside(path, "tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    created_mode = os.stat(
        tmp
    ).st_mode  # what the umask left; a writer that recreates tmp (safetensors) may not keep it
    try:
        write(tmp)
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            os.chmod(tmp, created_mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_directory(path: Path, fill: Callable[[Path], None]) -> None:
    """Call fill(tmp) on a new directory beside `path`, then put it in place of `path` (an old
    directory or nothing): a failed fill leaves `path` as it was. The old directory is renamed
    aside before the new one is renamed in, then deleted, so `path` is never half-written."""
    tmp = Path(_name_beside(path, "tmp"))
    os.mkdir(tmp, 0o777)  # the umask applies
    try:
        fill(tmp)
        old = Path(_name_beside(path, "old")) if path.exists() else None
        if old is not None:
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
