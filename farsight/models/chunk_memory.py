"""DRT chunk memory: per past chunk, its landmark key and its shared K/V rows.

`ChunkMemory` keeps the landmark keys ([B, n, d_model], scanned by every retrieval) on the compute
device and hands the K/V rows ([S, H, d] each per chunk and batch row, read only when retrieved)
to a store picked from `STORES`:

- "graph":  the training forward's own tensors, kept in the autograd graph;
- "device": pages of rows on the compute device;
- "host":   pages of rows in RAM (pinned when the compute device is CUDA);
- "disk":   a file of fixed-size records written with pwrite and read with pread, so neither
            the memory map nor the page cache counts towards the process's resident memory and
            RAM stays flat however long the context grows. A given `path` is created new (an
            existing file or a symlink is refused unless `overwrite=True`, which still refuses
            a symlink); by default the file is a temporary one in a farsight folder of the
            system's temporary directory, named with the process id, removed on close, at exit
            and on SIGTERM, and, if the process was killed, when a later process opens one.

A store answers append(k, v) / gather(index) / nbytes() / truncate(n) / close(). `gather(index)`
returns only the chunks that the index names (the K·G chunks of a retrieval) with the index remapped into
them, which is what the GCA op takes; the graph store returns all chunks and the index as is
(the op reads them in place, without a gathered copy in the graph). Pages are never copied when
the memory grows (a doubling buffer would copy the whole memory, 1 GB at 1M tokens, in the
middle of a decode step, and briefly hold it twice).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import re
import signal
import stat
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from farsight.errors import FarsightError, InputError
from farsight.ops import retrieval
from farsight.ops.buffers import GrowingBuffer

MEMORY_TIERS = ("device", "host", "disk")  # what a user picks; "graph" is the training forward's
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class KVStore(Protocol):
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, m, S, H, d] of m newly completed chunks."""

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [B, n, K] of chunk ids (-1 empty) -> (k [B, m, S, H, d], v, index into them)."""

    def nbytes(self) -> int:
        """Bytes of K/V stored."""

    def truncate(self, n_chunks: int) -> None:
        """Forget every chunk after the first n_chunks (undoes the appends of a failed session
        call; the inference stores only)."""

    def close(self) -> None:
        """Release files or buffers; the store is unusable afterwards."""


class GraphStore:
    """The training forward's chunks: plain tensors that stay in the autograd graph."""

    def __init__(self, device: torch.device, path: None = None, overwrite: bool = False) -> None:
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k.append(k)
        self._v.append(v)

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self._k[0] if len(self._k) == 1 else torch.cat(self._k, dim=1)
        v = self._v[0] if len(self._v) == 1 else torch.cat(self._v, dim=1)
        return k, v, index

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def close(self) -> None:
        self._k, self._v = [], []


class _PagedBuffer:
    """Rows appended along dim 1 into pages [B, page_rows, ...] that are never copied; pages
    double in size from 16 rows up to 1024, so small memories stay small."""

    FIRST_PAGE = 16
    MAX_PAGE = 1024

    def __init__(self, device: torch.device, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self.pages: list[torch.Tensor] = []
        self.starts = torch.zeros(0, dtype=torch.long)  # first row of each page
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        done = 0
        while done < rows.shape[1]:
            if not self.pages or self.length == int(self.starts[-1]) + self.pages[-1].shape[1]:
                size = min(self.MAX_PAGE, 2 * self.pages[-1].shape[1]) if self.pages else self.FIRST_PAGE
                page = torch.empty(
                    (rows.shape[0], size, *rows.shape[2:]), dtype=rows.dtype, device=self.device, pin_memory=self.pin
                )
                self.pages.append(page)
                self.starts = torch.cat([self.starts, torch.tensor([self.length])])
            at = self.length - int(self.starts[-1])
            n = min(rows.shape[1] - done, self.pages[-1].shape[1] - at)
            self.pages[-1][:, at : at + n] = rows[:, done : done + n]
            done += n
            self.length += n

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (sorted, on the CPU) -> [B, len(ids), ...] on the buffer's device."""
        page_of = torch.searchsorted(self.starts, ids, right=True) - 1
        parts = []
        for p in torch.unique_consecutive(page_of).tolist():
            parts.append(self.pages[p].index_select(1, (ids[page_of == p] - self.starts[p]).to(self.device)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def nbytes(self) -> int:
        return self.length * self.pages[0][:, :1].numel() * self.pages[0].element_size() if self.pages else 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` rows; pages that then hold none are dropped."""
        kept = int((self.starts < length).sum())
        self.pages = self.pages[:kept]
        self.starts = self.starts[:kept]
        self.length = min(self.length, length)


class PagedStore:
    """K and V of each chunk stacked ([B, m, S, 2, H, d]) in pages on the compute device, or in
    RAM (`on_host`; pinned when computing on CUDA, so copies to the GPU are asynchronous)."""

    def __init__(self, device: torch.device, path: None = None, overwrite: bool = False, on_host: bool = False) -> None:
        self.device = device
        self._on_host = on_host
        self._rows = self._new_rows()

    def _new_rows(self) -> _PagedBuffer:
        if self._on_host:
            return _PagedBuffer(torch.device("cpu"), pin=self.device.type == "cuda")
        return _PagedBuffer(self.device)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._rows.append(torch.stack([k, v], dim=3))

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, remapped = _remap(index)
        kv = self._rows.gather(ids.cpu()).to(self.device, non_blocking=self._rows.pin)
        return kv[:, :, :, 0], kv[:, :, :, 1], remapped

    def nbytes(self) -> int:
        return self._rows.nbytes()

    def truncate(self, n_chunks: int) -> None:
        self._rows.truncate(n_chunks)

    def close(self) -> None:
        self._rows = self._new_rows()


def _remap(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique chunk ids named by index (sorted, -1 dropped) and the index into that list."""
    flat = index.reshape(-1)
    ids = torch.unique(flat[flat >= 0])
    if len(ids) == 0:
        raise InputError("fetch needs at least one stored chunk id in index; skip empty retrievals")
    remapped = torch.searchsorted(ids, index.clamp(min=0))
    return ids, torch.where(index >= 0, remapped, index)


class DiskMemoryError(FarsightError, OSError):
    """The disk tier cannot be created or written; what was written before stays valid."""


_TEMP_NAME = re.compile(r"^chunks-(\d+)-.+\.kv$")  # chunks-<pid>-<random>.kv


class _TempFiles:
    """The default disk-tier files of this process: removed at exit and on SIGTERM (then the
    handler in place before, or the default action, runs); files of dead processes are removed
    when the next one starts."""

    paths: set[Path] = set()
    at_exit = False
    on_sigterm = False
    previous_sigterm: object = None

    @classmethod
    def folder(cls) -> Path:
        """farsight's folder for them: per user, 0700, not a symlink."""
        folder = Path(tempfile.gettempdir()) / f"farsight-{os.getuid()}"
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(folder)
        except OSError as exc:
            raise DiskMemoryError(
                exc.errno, f"cannot create {folder} for the disk tier ({exc.strerror}); pass path= to choose the file"
            ) from exc
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise DiskMemoryError(
                errno.EPERM,
                f"{folder} is not a private directory of this user; remove it or pass path= to choose the file",
            )
        return folder

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            pass
        return True

    @classmethod
    def remove_orphans(cls, folder: Path) -> None:
        """Remove the files of processes that no longer run and that no session holds (flock)."""
        for entry in folder.iterdir():
            match = _TEMP_NAME.match(entry.name)
            if not match or cls._alive(int(match.group(1))):
                continue
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                entry.unlink(missing_ok=True)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    @classmethod
    def add(cls, path: Path) -> None:
        cls.paths.add(path)
        if not cls.at_exit:
            atexit.register(cls.remove_all)
            cls.at_exit = True
        if not cls.on_sigterm:
            try:
                cls.previous_sigterm = signal.signal(signal.SIGTERM, cls._on_sigterm)
            except ValueError:  # not the main thread: if SIGTERM kills the process, the next one removes the file
                return
            cls.on_sigterm = True

    @classmethod
    def remove_all(cls) -> None:
        """Remove this process's files (not those a forked parent registered)."""
        for path in list(cls.paths):
            match = _TEMP_NAME.match(path.name)
            if match and int(match.group(1)) == os.getpid():
                path.unlink(missing_ok=True)
                cls.paths.discard(path)

    @classmethod
    def _on_sigterm(cls, signum: int, frame: object) -> None:
        cls.remove_all()
        previous = cls.previous_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


class FileStore:
    """K/V records in a file: chunk c occupies bytes [c * record, (c + 1) * record).

    The file is locked (flock) so that two sessions cannot share it. A chunk only counts as
    stored once its whole record is written; a failed write (disk full) raises DiskMemoryError,
    truncates the partial record away and leaves the earlier chunks readable. A given `path`
    must not exist (or pass overwrite=True) and must not be a symlink; without one, the file is
    a temporary one (see the module docstring).
    """

    def __init__(self, device: torch.device, path: str | os.PathLike | None = None, overwrite: bool = False) -> None:
        self.device = device
        self._owned = path is None
        if path is None:
            folder = _TempFiles.folder()
            _TempFiles.remove_orphans(folder)
            self._fd, name = tempfile.mkstemp(prefix=f"chunks-{os.getpid()}-", suffix=".kv", dir=folder)
            self.path = Path(name)
            _TempFiles.add(self.path)
        else:
            self.path = Path(path)
            self._fd = self._open(overwrite)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DiskMemoryError(
                errno.EBUSY, f"{self.path} is in use by another session; give each session its own path"
            ) from None
        os.ftruncate(self._fd, 0)
        self._record: int | None = None
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None
        self._torch_dtype: torch.dtype | None = None
        self._stored = 0

    def _open(self, overwrite: bool) -> int:
        """Open the given path: a new file, or an existing regular one with overwrite=True."""
        if self.path.is_symlink():
            raise DiskMemoryError(
                errno.ELOOP, f"disk memory path {self.path} is a symlink; give the path of a regular file"
            )
        if self.path.is_dir():
            raise DiskMemoryError(errno.EISDIR, f"disk memory path {self.path} is a directory; give a file path")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (0 if overwrite else os.O_EXCL)
        try:
            return os.open(self.path, flags, 0o600)
        except FileExistsError:
            raise DiskMemoryError(errno.EEXIST, self._exists_message()) from None
        except OSError as exc:
            raise DiskMemoryError(
                exc.errno, f"cannot open {self.path} for writing ({exc.strerror}); choose a writable path"
            ) from exc

    def _exists_message(self) -> str:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return f"disk memory path {self.path} already exists; choose a new path"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"{self.path} is in use by another session; give each session its own path"
        finally:
            os.close(fd)
        return f"disk memory path {self.path} already exists; choose a new path, or pass overwrite=True to replace it"

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        kv = torch.stack([k, v], dim=3).transpose(0, 1).contiguous().cpu()  # [m, B, S, 2, H, d]
        if self._shape is None:
            self._shape = tuple(kv.shape[1:])
            self._torch_dtype = kv.dtype
            self._dtype = (
                np.dtype(str(kv.dtype).replace("torch.", "")) if kv.dtype != torch.bfloat16 else np.dtype(np.uint16)
            )
            self._record = int(np.prod(self._shape)) * self._dtype.itemsize
        raw = kv.view(torch.uint16) if kv.dtype == torch.bfloat16 else kv
        data = raw.numpy().tobytes()
        offset = self._stored * self._record
        try:
            written = os.pwrite(self._fd, data, offset)
            if written != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            os.ftruncate(self._fd, offset)
            raise DiskMemoryError(
                exc.errno,
                f"writing chunk memory to {self.path} failed ({exc.strerror}); the {self._stored} chunks "
                "stored before are intact. Free disk space or use memory='host'.",
            ) from exc
        self._stored += kv.shape[0]

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, remapped = _remap(index)
        if self._shape is None:
            raise InputError("gather needs at least one stored chunk id in index; skip empty retrievals")
        out = np.empty((len(ids), *self._shape), dtype=self._dtype)
        for row, chunk in enumerate(ids.tolist()):
            buf = os.pread(self._fd, self._record, chunk * self._record)
            out[row] = np.frombuffer(buf, dtype=self._dtype).reshape(self._shape)
        kv = torch.from_numpy(out)
        if self._torch_dtype == torch.bfloat16:
            kv = kv.view(torch.bfloat16)
        kv = kv.transpose(0, 1).to(self.device)  # [B, m, S, 2, H, d]
        return kv[:, :, :, 0], kv[:, :, :, 1], remapped

    def nbytes(self) -> int:
        return self._stored * (self._record or 0)

    def truncate(self, n_chunks: int) -> None:
        if n_chunks < self._stored:
            os.ftruncate(self._fd, n_chunks * self._record)
            self._stored = n_chunks

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._owned:
                self.path.unlink(missing_ok=True)
                _TempFiles.paths.discard(self.path)


STORES: dict[str, Callable[[torch.device, str | os.PathLike | None, bool], KVStore]] = {
    "graph": GraphStore,
    "device": PagedStore,
    "host": partial(PagedStore, on_host=True),
    "disk": FileStore,
}


def resolve_kv_dtype(kv_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """None (keep the compute dtype), a floating torch.dtype, or one of KV_DTYPES' names."""
    if kv_dtype is None or kv_dtype in KV_DTYPES.values():
        return kv_dtype
    if kv_dtype in KV_DTYPES:
        return KV_DTYPES[kv_dtype]
    raise InputError(
        f"kv_dtype={kv_dtype!r} is not a storage dtype; choose one of {list(KV_DTYPES)} (or None: the model's)"
    )


class ChunkMemory:
    """Landmark keys on the compute device plus the chunks' K/V in a store (see the module docstring).

    In the graph tier the landmark keys stay autograd tensors (one block per forward); in the
    others they grow in one buffer that retrieval scans without copying. `kv_dtype` stores the
    K/V rows in another dtype than the model computes in (bf16/fp16 halve an fp32 model's
    memory on every tier); they are cast back when retrieved. Landmark keys keep the compute
    dtype: they decide the top-k. `path` and `overwrite` choose the disk tier's file.
    """

    def __init__(
        self,
        tier: str,
        device: torch.device,
        path: str | os.PathLike | None = None,
        kv_dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
    ) -> None:
        if tier not in STORES:
            raise InputError(f"memory={tier!r} is not a tier; choose one of {list(MEMORY_TIERS)}")
        if (path is not None or overwrite) and tier != "disk":
            raise InputError(f"path and overwrite are only used by memory='disk', not memory={tier!r}")
        self.tier = tier
        self.device = torch.device(device)
        self.kv_dtype = resolve_kv_dtype(kv_dtype)
        if self.kv_dtype is not None and tier == "graph":
            raise InputError(
                "kv_dtype is for the inference tiers; the training forward keeps K/V in the autograd graph"
            )
        self.store: KVStore = STORES[tier](self.device, path, overwrite)
        self._graph_keys: list[torch.Tensor] = []
        # keys are never written once appended, so their buffers spread each doubling over the
        # appends before it (a decode step at 16M tokens would otherwise pause to copy 128 MB)
        self._keys = GrowingBuffer(dim=1, spread_growth=True)
        # the inference tiers keep what retrieval's screens need (farsight.ops.retrieval): a
        # low-rank basis of the keys with a bound on their norms (after a truncate the bound stays
        # an upper bound) and, where bf16 GEMMs run in hardware, the landmark keys in bf16 (a copy
        # only when the keys are not bf16 themselves) for keys without such a basis
        self._screened = tier != "graph" and retrieval.screen_pays_off(self.device)
        self._screen_keys = GrowingBuffer(dim=1, spread_growth=True)
        self._low_rank = retrieval.LowRankKeys(retrieval.LOW_RANK_MIN_KEYS) if tier != "graph" else None

    @property
    def n_chunks(self) -> int:
        return sum(k.shape[1] for k in self._graph_keys) if self.tier == "graph" else self._keys.length

    def landmark_keys(self) -> torch.Tensor:
        """[B, n_chunks, d_model]"""
        if self.tier == "graph":
            return self._graph_keys[0] if len(self._graph_keys) == 1 else torch.cat(self._graph_keys, dim=1)
        return self._keys.view()

    def screen_state(self) -> dict[str, object]:
        """The keyword arguments of `farsight.ops.retrieval.retrieval_topk` that carry this
        memory's screen: {"keys_low": keys in bf16 [B, n_chunks, D], "max_key_norm": a scalar >=
        every key's L2 norm} where the bf16 screen pays, and {"low_rank": LowRankKeys} on every
        inference tier; {} in the graph tier (a screen computes what it needs from the keys)."""
        state: dict[str, object] = {} if self._low_rank is None else {"low_rank": self._low_rank}
        if self._screened:
            keys = self._keys.view()
            keys_low = keys if keys is not None and keys.dtype == torch.bfloat16 else self._screen_keys.view()
            state.update(keys_low=keys_low, max_key_norm=self._low_rank.max_norm)  # the bound both screens take
        return state

    def append(self, landmark_keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """landmark_keys [B, m, D]; k, v [B, m, S, H, d] for m newly completed chunks. The store
        is written first: if it fails, the memory still holds exactly the earlier chunks."""
        if landmark_keys.shape[1] == 0:
            return
        if self.tier == "graph":
            self.store.append(k, v)
            self._graph_keys.append(landmark_keys)
        else:
            dtype = self.kv_dtype or k.dtype
            self.store.append(k.detach().to(dtype), v.detach().to(dtype))
            keys = self._keys.append(landmark_keys.detach().to(self.device))
            if self._low_rank is not None:
                self._low_rank.update(keys)
            if self._screened and keys.dtype != torch.bfloat16:
                self._screen_keys.append(keys[:, keys.shape[1] - landmark_keys.shape[1] :].to(torch.bfloat16))

    def truncate(self, n_chunks: int) -> None:
        """Keep the first n_chunks chunks (an inference tier): undoes the appends of a failed session call."""
        self.store.truncate(n_chunks)
        self._keys.truncate(n_chunks)
        self._screen_keys.truncate(n_chunks)
        if self._low_rank is not None:
            self._low_rank.truncate(n_chunks)

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [B, n, K] of chunk ids (-1 empty) -> (k [B, m, S, H, d], v, index into them)."""
        return self.store.gather(index)

    def nbytes(self) -> int:
        """Bytes of K/V stored (in whatever tier) plus landmark keys (and their bf16 copy or
        low-rank coordinates)."""
        keys = (
            sum(k.numel() * k.element_size() for k in self._graph_keys)
            + self._keys.nbytes()
            + self._screen_keys.nbytes()
        )
        if self._low_rank is not None:
            keys += self._low_rank.coords.nbytes() + self._low_rank.residuals.nbytes()
        return self.store.nbytes() + keys

    def close(self) -> None:
        """Release files and buffers (the landmark keys too: at 16M tokens they and their bf16
        copy take up to 0.5 GB, which must not wait for the session object to be collected);
        the memory is unusable afterwards."""
        self.store.close()
        self._graph_keys = []
        self._keys.clear()
        self._screen_keys.clear()
        if self._low_rank is not None:
            self._low_rank = retrieval.LowRankKeys(retrieval.LOW_RANK_MIN_KEYS)
