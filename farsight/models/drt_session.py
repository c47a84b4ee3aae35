"""Streaming inference over contexts of any length for a causal-retrieval LM: DRT or any model
built from farsight.models.causal_retrieval (docs/design.md §2.6).

A session owns the state the model's span forward carries: one decoding cache per decoder
layer (DRT's rolling W-slot caches), the lower-layer rows of the incomplete chunk, the current
retrieval per group and the chunk memory (landmark keys on the compute device, chunk K/V in the
chosen tier). Tokens go in as tensors or as an iterator of token blocks (a 16M-token file can
stream from disk); the runtime inserts a landmark after every S real tokens and runs many chunks
per span, so the lower layers, the encoder, retrieval and the upper layers are vectorised over a
segment while nothing grows with the context except the chunk memory (and the caches of layers
that attend to everything).

The session reads the model only through the component's interface: `config` (chunk_size,
landmark_id, pad_id), `slots_per_chunk`, `new_caches()`, `pad_slots`, `run_span`, `norm` and
`lm_head`.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from farsight.errors import InputError
from farsight.models.chunk_memory import ChunkMemory
from farsight.models.drt_state import DRTState, RetrievalInfo
from farsight.models.session import Session


class DRTSession(Session):
    """The Session protocol (farsight.models.session) over a causal-retrieval model's span
    forward; the landmark slots never reach the caller.

    memory: "device", "host" (RAM, pinned on CUDA) or "disk" (a new file at `path`, an existing
    one only with overwrite=True; a temporary file by default). kv_dtype: storage dtype of the
    chunk K/V ("fp32", "bf16", "fp16" or a torch dtype; default the model's compute dtype). segment_chunks: chunks per span when a long input is processed (speed vs peak
    activation memory). record_retrieval keeps every retrieval made (see RetrievalInfo).

    A call that fails (e.g. the disk tier's ENOSPC) leaves the caches, the carried state, the
    chunk memory and the records as they were before it, so the same tokens can be fed again.

    The prompt (the first prefill) is left-padded with `prompt_offset` pad slots so that it ends
    on a chunk boundary (docs/design.md §2.1): its last landmark sees the whole prompt and the first answer
    token starts a chunk that reads that landmark's retrieval, wherever the question falls. Pads
    (and the rows' own left padding given by an attention_mask) are masked out of the sliding
    window, the chunk encoder and GCA, and chunks of nothing but padding are never retrieved.
    """

    def __init__(
        self,
        model: Any,
        batch_size: int = 1,
        memory: str = "device",
        path: str | os.PathLike | None = None,
        segment_chunks: int = 64,
        record_retrieval: bool = False,
        kv_dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
    ) -> None:
        if not isinstance(segment_chunks, int) or segment_chunks < 1:
            raise InputError(f"segment_chunks must be an integer >= 1, got {segment_chunks!r}")
        super().__init__(model, batch_size)
        self.config = model.config
        self.segment_slots = segment_chunks * model.slots_per_chunk
        self.memory = ChunkMemory(memory, self.device, path, kv_dtype, overwrite)
        self._pads_due = 0  # alignment pads still to be fed in front of the prompt's first block
        self.state = DRTState(
            memory=self.memory,
            caches=model.new_caches(),
            record=RetrievalInfo([], []) if record_retrieval else None,
        )

    def _release(self) -> None:
        self.memory.close()

    def _begin(self, length: int | None, attention_mask: torch.Tensor | None) -> None:
        self.prompt_offset = self._pads_due = 0 if length is None else -length % self.config.chunk_size
        lead = torch.full((self.batch_size,), self.prompt_offset, device=self.device)
        if attention_mask is not None:
            lead += (~attention_mask).sum(1)
        self.state.pad = self.model.pad_slots(lead)

    def _mark(self) -> dict[str, Any]:
        # shallow copies are snapshots: a span replaces the pending rows and the carried
        # retrievals rather than writing into them, a cache's copy keeps what it held
        # (`new_caches`), and the memory only grows
        state = self.state
        return {
            "slots": state.slots,
            "pending": state.pending,
            "caches": [copy.copy(cache) for cache in state.caches],
            "retrieval": None if state.retrieval is None else [copy.copy(carried) for carried in state.retrieval],
            "chunks": self.memory.n_chunks,
            "records": None if state.record is None else len(state.record.indices),
            "pads_due": self._pads_due,
        }

    def _undo(self, mark: dict[str, Any]) -> None:
        state = self.state
        state.slots, state.pending, state.caches, state.retrieval = (
            mark["slots"],
            mark["pending"],
            mark["caches"],
            mark["retrieval"],
        )
        self.memory.truncate(mark["chunks"])
        self._pads_due = mark["pads_due"]
        if state.record is not None:
            del state.record.indices[mark["records"] :], state.record.weights[mark["records"] :]

    @property
    def retrievals(self) -> RetrievalInfo | None:
        """Retrievals made so far, per group a list of [B, m, K] blocks (one per span), or None."""
        return self.state.record

    def retrieved_chunks(self) -> list[set[int]] | None:
        if not self.state.retrieval:
            return None
        rows = torch.cat([carried.index for carried in self.state.retrieval], dim=1).tolist()
        return [{c for c in row if c >= 0} for row in rows]

    def _slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] -> slot ids [B, P] with the pads and landmarks due, and the slot
        offsets of the T tokens."""
        s = self.config.chunk_size
        pads = self._pads_due
        if pads:
            pad_id = self.config.pad_id if self.config.pad_id is not None else 0
            ids = torch.cat([ids.new_full((ids.shape[0], pads), pad_id), ids], dim=1)
        done = (self.tokens_seen + self.prompt_offset - pads) % s
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        offsets = positions + (done + positions) // s
        slots = ids.new_full((ids.shape[0], t + (done + t) // s), self.config.landmark_id)
        slots[:, offsets] = ids
        return slots, offsets[pads:]

    def _run(self, ids: torch.Tensor, every_position: bool) -> torch.Tensor:
        slots, offsets = self._slots(ids)
        self._pads_due = 0
        start = self.state.slots
        s1 = self.model.slots_per_chunk
        last = int(offsets[-1])
        rows = []
        pos = 0
        while pos < slots.shape[1]:
            # cut spans at chunk boundaries of the absolute stream so most spans are whole chunks
            end = min(slots.shape[1], ((start + pos) // s1) * s1 + self.segment_slots - start)
            h = self.model.run_span(slots[:, pos:end], self.state)
            if every_position:
                rows.append(h[:, offsets[(offsets >= pos) & (offsets < end)] - pos])
            elif pos <= last < end:
                rows.append(h[:, last - pos][:, None])
            pos = end
        h = torch.cat(rows, dim=1)
        return self.model.lm_head(self.model.norm(h))
