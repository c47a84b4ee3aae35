"""File helpers every layer shares: replacing a file or a folder atomically, a file's SHA-256,
folders made for a write and removed if it fails, the one-line error of a failed write, what a
folder holds (`folder_kind`, `claim_output_folder`) and the lock a process holds on a folder it
writes (`folder_lock`)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from farsight.errors import FolderInUseError, InputError, WriteError

try:
    import fcntl
except ImportError:  # Windows: folders are not locked (see folder_lock)
    fcntl = None

logger = logging.getLogger(__name__)

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
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as exc:  # nothing is written yet: the folder refuses files (permissions, read-only, gone)
        raise write_failure(path, exc) from exc
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


def can_create_in(folder: Path) -> OSError | None:
    """Whether a file can be created in the existing `folder`, found by creating (and removing) an
    empty one: the error that refused it, or None. Permission bits alone do not tell (root passes
    them, and a read-only or virtual file system refuses whatever they say)."""
    probe = _name_beside(folder / "probe", "probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as exc:
        return exc
    os.unlink(probe)
    return None


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


# ---- what a folder holds ------------------------------------------------------------------------
# what each kind of folder farsight writes is called in messages; `folder_kind` tells them apart
FOLDER_KINDS = {
    "run": "a training run",
    "checkpoint": "a training checkpoint",
    "model": "a model",
    "dataset": "a prepared dataset",
    "tokenizer": "a tokenizer",
    "tasks": "exported lm-eval tasks",
    "results": "demo results",
}
# hidden names a write leaves inside a folder while it runs (or after a kill): not contents
_WRITE_LEFTOVER = re.compile(r"^\.(prepare-.*|.*\.(tmp|old|lock))$")


def folder_kind(path: str | os.PathLike) -> str | None:
    """What the folder `path` holds, told by the files farsight writes there: a key of
    FOLDER_KINDS, "other" (files no farsight command writes in that layout), or None (no folder,
    or an empty one). A run has checkpoints/ or metrics.jsonl; a checkpoint its manifest or
    trainer state; a model config.json or model.safetensors; a dataset a farsight meta.json or
    token files; a tokenizer tokenizer.json alone; lm-eval tasks their loader or template; demo
    results passkey.json."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    names = {entry.name for entry in folder.iterdir() if not _WRITE_LEFTOVER.match(entry.name)}
    if not names:
        return None
    if (folder / "checkpoints").is_dir() or "metrics.jsonl" in names:
        return "run"
    if names & {"manifest.json", "trainer_state.safetensors"}:  # not trainer_state.json alone: transformers' too
        return "checkpoint"
    if names & {"config.json", "model.safetensors"}:
        return "model"
    if _farsight_meta(folder / "meta.json") or {"train.bin", "train.docs.npy"} <= names:
        return "dataset"
    if names == {"tokenizer.json"}:
        return "tokenizer"
    if names & {"farsight_data.py", "_farsight_ruler_template.yaml"}:
        return "tasks"
    if "passkey.json" in names:
        return "results"
    return "other"


def _farsight_meta(path: Path) -> bool:
    """Whether `path` is the meta.json of a prepared dataset (not another tool's meta.json)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == "farsight-tokens"


def describe_folder(path: str | os.PathLike, kind: str | None = None) -> str:
    """What the folder `path` holds, in words: "a model", "other files (a.txt, b.txt, ...)"..."""
    kind = folder_kind(path) if kind is None else kind
    if kind is None:
        return "nothing"
    if kind != "other":
        return FOLDER_KINDS[kind]
    names = sorted(entry.name for entry in Path(path).iterdir() if not _WRITE_LEFTOVER.match(entry.name))
    return f"other files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def claim_output_folder(
    path: str | os.PathLike,
    kind: str,
    overwrite: bool = False,
    *,
    name: str = "",
    fix: str = "pass a new or empty folder, or --force (overwrite=True) to write there anyway",
) -> str | None:
    """Refuse (InputError) to write `kind` (a key of FOLDER_KINDS) into the folder `path` when it
    holds something else, whose files the write could replace or mix with its own: a folder is
    written when it is new, empty or of the same kind (a dataset replaces a dataset), anything
    else (a model, a tokenizer, a run, a folder of other files) only with `overwrite` (the CLI's
    --force). `name`: how the message names the folder (e.g. "--out runs/data"; default the path);
    `fix`: what the message tells to do. Returns what the folder holds (`folder_kind`)."""
    folder = Path(path)
    name = name or str(path)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{name} is a file, not a folder; pass a new folder for {FOLDER_KINDS[kind]}")
    held = folder_kind(folder)
    if held is None or held == kind or overwrite:
        return held
    raise InputError(
        f"{name} holds {describe_folder(folder, held)}, not {FOLDER_KINDS[kind]}, and writing there would replace or "
        f"mix with its files; {fix}"
    )


# ---- the lock of a folder being written ---------------------------------------------------------
def lock_file(path: str | os.PathLike) -> Path:
    """The lock file of the folder `path`: .NAME.lock beside it (not inside, so that it outlives a
    folder replaced whole, and a folder not made yet can be locked)."""
    folder = Path(os.path.abspath(path))
    return folder.parent / f".{folder.name}.lock"


def _lock_owner(fd: int) -> dict | None:
    """The owner a lock file records (pid, host, since, what), or None if it records none."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        owner = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _owner_text(owner: dict | None) -> str:
    if owner is None:
        return "another process (starting up)"
    return f"{owner.get('what', 'another process')} (pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')})"


@contextlib.contextmanager
def folder_lock(path: str | os.PathLike, what: str, fix: str = "pass another folder") -> Iterator[None]:
    """Hold the lock of the folder `path` while the block writes it, so that no second process
    writes the same folder at once: a second one is refused (FolderInUseError) in one line naming
    the owner (`what`, e.g. "farsight train", its pid, host and start time) and `fix`.

    The lock is an flock on `lock_file(path)`, which records its owner and is removed when the
    block ends. The system drops an flock when its process dies, however it dies, so a lock file
    left by a killed process is stale: the next writer takes it over (with a warning naming the
    process that is gone). The folder above `path` must exist. POSIX only: where there is no
    fcntl (Windows) the block runs unlocked. Locks of one process are not shared: a second lock
    on the same folder in the same process is refused too."""
    if fcntl is None:
        yield
        return
    lock = lock_file(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:  # a folder without write permission, a read-only or full file system
            raise write_failure(path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            os.close(fd)
            raise FolderInUseError(
                f"{path} is being written by {_owner_text(owner)}; wait for it to end, or {fix}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # the owner before us removes the file as it lets go: ours must still be the one at that name
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)
    try:
        stale = _lock_owner(fd)
        if stale is not None:
            logger.warning("%s: taking over the lock left by %s, which is gone", path, _owner_text(stale))
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
            "what": what,
        }
        try:  # the owner is for messages: a disk too full to record it does not stop the write
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(owner).encode("utf-8"))
        except OSError as exc:
            logger.debug("cannot record the owner in %s: %s", lock, exc)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


@contextlib.contextmanager
def writing_folder(
    path: str | os.PathLike,
    kind: str,
    what: str,
    overwrite: bool = False,
    *,
    name: str = "",
    fix: str = "pass another folder",
) -> Iterator[None]:
    """Around a block that writes `kind` (a key of FOLDER_KINDS) into the folder `path`, as every
    command that writes a folder does: the folders above it are made (and removed again if the
    block fails), the folder is locked against other writers (`folder_lock`, the owner named as
    `what`, `fix` said to the one refused), then claimed (`claim_output_folder`: refused when it
    holds something else, unless `overwrite`), and a write that fails for want of space is one
    line (`reported_write`)."""
    with new_folders_for(path), reported_write(path), folder_lock(path, what, fix):
        claim_output_folder(path, kind, overwrite, name=name)
        yield
