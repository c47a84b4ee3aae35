"""Streaming inference for DRT over contexts of any length (SPEC 2.6).

A session owns the state the model's span forward carries: one rolling KV cache of W slots per
decoder layer, the lower-layer rows of the incomplete chunk, the current retrieval per group and
the chunk memory (landmark keys on the compute device, chunk K/V in the chosen tier). Tokens go
in as tensors or as an iterator of token blocks (a 16M-token file can stream from disk); the
runtime inserts a landmark after every S real tokens and runs many chunks per span, so the
lower layers, the encoder, retrieval and the upper layers are vectorised over a segment while
nothing grows with the context except the chunk memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from farsight.layers.kv_cache import SlidingKVCache
from farsight.models.chunk_memory import make_memory
from farsight.models.drt import DRTForCausalLM, DRTState, RetrievalInfo
from farsight.models.lm import check_input_ids, generate_tokens


class DRTSession:
    """Feed tokens with `prefill` / `step` / `score`; the landmark slots never reach the caller.

    memory: "device", "host" (RAM, pinned on CUDA) or "disk" (a file at `path`, a temporary file
    by default). segment_chunks: chunks per span when a long input is processed (speed vs peak
    activation memory). record_retrieval keeps every retrieval made (see RetrievalInfo).
    """

    def __init__(
        self,
        model: DRTForCausalLM,
        batch_size: int = 1,
        memory: str = "device",
        path: str | os.PathLike | None = None,
        segment_chunks: int = 64,
        record_retrieval: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if segment_chunks < 1:
            raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
        self.model = model
        self.config = model.config
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self.segment_slots = segment_chunks * model.slots_per_chunk
        self.memory = make_memory(memory, self.device, path)
        self.state = DRTState(
            memory=self.memory,
            caches=[SlidingKVCache(self.config.window) for _ in model.layers()],
            record=RetrievalInfo([], []) if record_retrieval else None,
        )
        self.tokens_seen = 0
        self._closed = False

    # ---- context manager ----------------------------------------------------------------------
    def __enter__(self) -> DRTSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self.memory.close()
            self._closed = True

    @property
    def retrievals(self) -> RetrievalInfo | None:
        """Retrievals made so far, per group a list of [B, m, K] blocks (one per span), or None."""
        return self.state.record

    # ---- feeding tokens -------------------------------------------------------------------------
    def _slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] -> slot ids [B, P] with the landmarks due, and the slot offsets of the tokens."""
        s = self.config.chunk_size
        done = self.tokens_seen % s
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        offsets = positions + (done + positions) // s
        slots = ids.new_full((ids.shape[0], t + (done + t) // s), self.config.landmark_id)
        slots[:, offsets] = ids
        return slots, offsets

    @torch.inference_mode()
    def _feed(self, ids: torch.Tensor, want: str) -> torch.Tensor | None:
        """Process ids [B, T]; return the final hidden rows of its tokens ("all"), of its last token ("last")."""
        if self._closed:
            raise RuntimeError("this session is closed; start a new one with model.new_session()")
        ids = check_input_ids(ids.to(self.device), self.config.vocab_size, {"landmark": self.config.landmark_id})
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"the session was opened for batch_size={self.batch_size}, got {ids.shape[0]} rows")
        if ids.shape[1] == 0:
            return None
        slots, offsets = self._slots(ids)
        start = self.state.slots
        s1 = self.model.slots_per_chunk
        outputs = []
        pos = 0
        while pos < slots.shape[1]:
            # cut spans at chunk boundaries of the absolute stream so most spans are whole chunks
            absolute = start + pos
            end_abs = (absolute // s1) * s1 + self.segment_slots
            end = min(slots.shape[1], end_abs - start)
            h = self.model.run_span(slots[:, pos:end], self.state)
            if want == "all":
                keep = offsets[(offsets >= pos) & (offsets < end)] - pos
                outputs.append(h[:, keep])
            elif want == "last" and pos <= int(offsets[-1]) < end:
                outputs.append(h[:, int(offsets[-1]) - pos][:, None])
            pos = end
        self.tokens_seen += ids.shape[1]
        return torch.cat(outputs, dim=1) if outputs else None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.norm(h))

    def prefill(self, ids: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
        """Feed a prompt (a [B, T] / [T] tensor, or an iterator of such blocks); returns the
        next-token logits [B, V] after its last token."""
        blocks = [ids] if isinstance(ids, torch.Tensor) else ids
        last = None
        for block in blocks:
            block = block[None] if block.dim() == 1 else block
            h = self._feed(block, "last")
            if h is not None:
                last = h
        if last is None:
            raise ValueError("prefill got no tokens")
        return self._logits(last[:, -1])

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] or [B, 1]); returns next-token logits [B, V]."""
        token = token.reshape(self.batch_size, 1)
        return self._logits(self._feed(token, "last")[:, -1])

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, T]; return the logits [B, T, V] predicted after each of them."""
        ids = ids[None] if ids.dim() == 1 else ids
        h = self._feed(ids, "all")
        return self._logits(h)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Prefill input_ids [B, T] and sample up to max_new_tokens; returns [B, T + new]."""
        input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
        return generate_tokens(
            self.prefill, self.step, input_ids.to(self.device), max_new_tokens, temperature, top_k, top_p, eos_token_id, generator
        )
