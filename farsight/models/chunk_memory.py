"""DRT chunk memory: per past chunk, its landmark key and its shared K/V rows.

Landmark keys ([B, n, d_model], scanned by every retrieval) always live on the compute device.
The K/V rows ([S, H, d] each per chunk and batch row, read only when retrieved) live in a tier:

- "graph":  the training forward's own tensors, kept in the autograd graph;
- "device": pages of rows on the compute device;
- "host":   pages of rows in RAM (pinned when the compute device is CUDA);
- "disk":   a file of fixed-size records written with pwrite and read with pread, so neither
            the memory map nor the page cache counts towards the process's resident memory and
            RAM stays flat however long the context grows.

Pages are never copied when the memory grows (a doubling buffer would copy the whole memory,
1 GB at 1M tokens, in the middle of a decode step, and briefly hold it twice).
`fetch(index)` gathers only the chunks that the index names (the K·G chunks of a retrieval) and
returns them with the index remapped into them, which is what the GCA op takes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

TIERS = ("device", "host", "disk")


class _GrowingBuffer:
    """Rows appended along dim 1 of a [B, capacity, ...] tensor that doubles when full."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, rows: torch.Tensor, device: torch.device) -> None:
        new = rows.shape[1]
        if self.data is None or self.length + new > self.data.shape[1]:
            capacity = max(16, self.length + new, 0 if self.data is None else 2 * self.data.shape[1])
            grown = torch.empty((rows.shape[0], capacity, *rows.shape[2:]), dtype=rows.dtype, device=device)
            if self.data is not None:
                grown[:, : self.length] = self.data[:, : self.length]
            self.data = grown
        self.data[:, self.length : self.length + new] = rows
        self.length += new

    def view(self) -> torch.Tensor:
        return self.data[:, : self.length]


class ChunkMemory:
    """Base: landmark keys on the compute device plus K/V rows in a tier (see module docstring)."""

    tier = "graph"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._landmarks = _GrowingBuffer()

    @property
    def n_chunks(self) -> int:
        return self._landmarks.length

    def landmark_keys(self) -> torch.Tensor:
        """[B, n_chunks, d_model]"""
        return self._landmarks.view()

    def append(self, landmark_keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """landmark_keys [B, m, D]; k, v [B, m, S, H, d] for m newly completed chunks."""
        if landmark_keys.shape[1] == 0:
            return
        self._append_kv(k.detach(), v.detach())
        self._landmarks.append(landmark_keys.detach(), self.device)

    def _append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [B, n, K] of chunk ids (-1 empty) -> (k [B, m, S, H, d], v, index into them)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release files or buffers; the memory is unusable afterwards."""

    def nbytes(self) -> int:
        """Bytes of K/V stored (in whatever tier) plus landmark keys."""
        keys = self._landmarks.view()
        return keys.numel() * keys.element_size() if self._landmarks.data is not None else 0


class GraphMemory(ChunkMemory):
    """The training forward's memory: plain tensors that stay in the autograd graph."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._keys: list[torch.Tensor] = []
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._n = 0

    @property
    def n_chunks(self) -> int:
        return self._n

    def landmark_keys(self) -> torch.Tensor:
        return self._keys[0] if len(self._keys) == 1 else torch.cat(self._keys, dim=1)

    def append(self, landmark_keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if landmark_keys.shape[1] == 0:
            return
        self._keys.append(landmark_keys)
        self._k.append(k)
        self._v.append(v)
        self._n += landmark_keys.shape[1]

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self._k[0] if len(self._k) == 1 else torch.cat(self._k, dim=1)
        v = self._v[0] if len(self._v) == 1 else torch.cat(self._v, dim=1)
        return k, v, index


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
                page = torch.empty((rows.shape[0], size, *rows.shape[2:]), dtype=rows.dtype, device=self.device, pin_memory=self.pin)
                self.pages.append(page)
                self.starts = torch.cat([self.starts, torch.tensor([self.length])])
            at = self.length - int(self.starts[-1])
            n = min(rows.shape[1] - done, self.pages[-1].shape[1] - at)
            self.pages[-1][:, at : at + n] = rows[:, done : done + n]
            done += n
            self.length += n

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (sorted, on the CPU) -> [B, len(ids), ...]."""
        page_of = torch.searchsorted(self.starts, ids, right=True) - 1
        parts = []
        for p in torch.unique_consecutive(page_of).tolist():
            parts.append(self.pages[p].index_select(1, (ids[page_of == p] - self.starts[p]).to(self.device)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def nbytes(self) -> int:
        return self.length * self.pages[0][:, :1].numel() * self.pages[0].element_size() if self.pages else 0


class DeviceMemory(ChunkMemory):
    tier = "device"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._kv = self._new_buffer()

    def _new_buffer(self) -> _PagedBuffer:
        return _PagedBuffer(self.device)

    def _append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._kv.append(torch.stack([k, v], dim=3))  # [B, m, S, 2, H, d]

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, remapped = _remap(index)
        kv = self._kv.gather(ids.cpu()).to(self.device, non_blocking=self._kv.pin)
        return kv[:, :, :, 0], kv[:, :, :, 1], remapped

    def nbytes(self) -> int:
        return super().nbytes() + self._kv.nbytes()

    def close(self) -> None:
        self._kv = self._new_buffer()


def _remap(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique chunk ids named by index (sorted, -1 dropped) and the index into that list."""
    flat = index.reshape(-1)
    ids = torch.unique(flat[flat >= 0])
    if len(ids) == 0:
        raise ValueError("fetch needs at least one stored chunk id in index; skip empty retrievals")
    remapped = torch.searchsorted(ids, index.clamp(min=0))
    return ids, torch.where(index >= 0, remapped, index)


class HostMemory(DeviceMemory):
    """The device tier's pages kept in RAM instead, pinned for fast copies when computing on CUDA."""

    tier = "host"

    def _new_buffer(self) -> _PagedBuffer:
        return _PagedBuffer(torch.device("cpu"), pin=self.device.type == "cuda")


class DiskMemoryError(OSError):
    """The disk tier cannot be created or written; what was written before stays valid."""


class DiskMemory(ChunkMemory):
    """K/V records in a file: chunk c occupies bytes [c * record, (c + 1) * record).

    The file is locked (flock) so that two sessions cannot share it. A chunk only counts as
    stored once its whole record is written; a failed write (disk full) raises DiskMemoryError,
    truncates the partial record away and leaves the earlier chunks readable.
    """

    tier = "disk"

    def __init__(self, device: torch.device, path: str | os.PathLike | None = None) -> None:
        super().__init__(device)
        self._owned = path is None
        if path is None:
            fd, name = tempfile.mkstemp(prefix="farsight-chunks-", suffix=".kv")
            os.close(fd)
            path = name
        self.path = Path(path)
        if self.path.is_dir():
            raise DiskMemoryError(errno.EISDIR, f"disk memory path {self.path} is a directory; give a file path")
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DiskMemoryError(exc.errno, f"cannot open {self.path} for writing ({exc.strerror}); choose a writable path") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DiskMemoryError(errno.EBUSY, f"{self.path} is in use by another session; give each session its own path") from None
        os.ftruncate(self._fd, 0)
        self._record: int | None = None
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None
        self._torch_dtype: torch.dtype | None = None
        self._stored = 0

    def _append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        kv = torch.stack([k, v], dim=3).transpose(0, 1).contiguous().cpu()  # [m, B, S, 2, H, d]
        if self._shape is None:
            self._shape = tuple(kv.shape[1:])
            self._torch_dtype = kv.dtype
            self._dtype = np.dtype(str(kv.dtype).replace("torch.", "")) if kv.dtype != torch.bfloat16 else np.dtype(np.uint16)
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

    def fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, remapped = _remap(index)
        if self._shape is None:
            raise ValueError("fetch needs at least one stored chunk id in index; skip empty retrievals")
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
        return super().nbytes() + self._stored * (self._record or 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._owned:
                self.path.unlink(missing_ok=True)


def make_memory(tier: str, device: torch.device, path: str | os.PathLike | None = None) -> ChunkMemory:
    if tier not in TIERS:
        raise ValueError(f"memory={tier!r} is not a tier; choose one of {list(TIERS)}")
    if path is not None and tier != "disk":
        raise ValueError(f"path is only used by memory='disk', not memory={tier!r}")
    if tier == "device":
        return DeviceMemory(device)
    if tier == "host":
        return HostMemory(device)
    return DiskMemory(device, path)
