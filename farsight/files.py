"""File helpers every layer shares: replacing a file or a folder atomically, a file's SHA-256,
folders made for a write and removed if it fails, and the one-line error of a failed write."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from farsight.errors import WriteError

# errors of a write that the user fixes on the disk, not in farsight: reported as one line
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
WRITE_FAILURES = DISK_FULL | {errno.EROFS}


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


def write_failure(path: str | os.PathLike, exc: OSError, then: str = "run the command again") -> WriteError:
    """The one-line error of a write under `path` that failed with `exc` (a full disk, a
    read-only file system...); `then` is what to do once space is freed."""
    if exc.errno in DISK_FULL:
        return WriteError(f"disk full at {path} ({exc.strerror}); free some space and {then}")
    return WriteError(f"cannot write {path} ({exc.strerror or exc}); check the permissions and space of that folder")


@contextlib.contextmanager
def reported_write(path: str | os.PathLike, then: str = "run the command again") -> Iterator[None]:
    """Turn a write under `path` that fails for want of space (or on a read-only file system)
    into `write_failure`'s one-line error; any other error passes unchanged."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, WriteError) or exc.errno not in WRITE_FAILURES:
            raise
        raise write_failure(path, exc, then) from exc


def os_error_of(exc: Exception, path: str | os.PathLike) -> OSError | None:
    """The OSError inside a writer's own exception type that names it only in its message (e.g.
    safetensors' "I/O error: No space left on device (os error 28)"), or None."""
    match = re.search(r"os error (\d+)", str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), os.fspath(path))


@contextlib.contextmanager
def new_folders_for(path: str | os.PathLike) -> Iterator[None]:
    """Make the missing folders above `path`; if the block fails (or is interrupted), remove the
    ones made here again, so a failed write leaves no empty folders behind."""
    missing = []
    parent = Path(path).absolute().parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    made = []
    try:
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
            made.append(folder)
        yield
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
