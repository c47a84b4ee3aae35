"""The state a causal-retrieval span forward hands to the next span, and its retrieval records.

Shared by the component (farsight.models.causal_retrieval, DRT's and any model's built from it)
and its streaming session (farsight.models.drt_session) so that neither imports the other's
internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from farsight.models.chunk_memory import ChunkMemory


@dataclass
class RetrievalInfo:
    """Per group g, the retrieval made by chunk t's landmark (used by chunk t+1):
    indices[g] [B, n, K] chunk ids (-1 empty) and weights[g] [B, n, K]."""

    indices: list[torch.Tensor]
    weights: list[torch.Tensor]


@dataclass
class FetchedChunks:
    """The chunks a retrieval reads, as the GCA op takes them: k, v [B, m, S, H, d] and, per
    query chunk, index [B, n, K] into those m chunks (-1 empty) with softmax weights [B, n, K];
    key_mask [B, n, K, S] (True = real key) when a retrieved chunk holds left padding, else None."""

    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor
    weight: torch.Tensor
    key_mask: torch.Tensor | None = None


@dataclass
class CarriedRetrieval:
    """One group's retrieval for the stream's current chunk: index [B, K] of chunk ids (-1 empty)
    and weight [B, K]. `fetched` keeps its chunks once read from the memory tier, so the tokens
    of a chunk read them once, not once per token."""

    index: torch.Tensor
    weight: torch.Tensor
    fetched: FetchedChunks | None = None


@dataclass
class PackedLayout:
    """A packed row on the chunk grid: every document starts on a chunk boundary (the last chunk
    of the document before it is right-padded, as a document run alone pads its last chunk).

    token_slots [B, L]: the slot of each input token; slot_documents [B, P]: the document id of
    each slot (landmarks and padding slots belong to their chunk's document; chunks after a row's
    last document get an id of their own); first_chunk [B, n]: the first chunk of each chunk's
    document, the earliest chunk it may retrieve.
    """

    token_slots: torch.Tensor
    slot_documents: torch.Tensor
    first_chunk: torch.Tensor


@dataclass
class DRTState:
    """What a span hands to the next one.

    caches: one decoding cache per decoder layer (DRT's: a rolling KV cache), or None in the
    training forward (one span from slot 0, everything in the autograd graph); slots: slots
    processed so far; pending: lower-layer outputs of the incomplete chunk [B, r, D]; retrieval:
    per group, the retrieval the current chunk reads (None before the first span); record: every
    retrieval made, if kept; pad: [B] long, the slots before pad[b] are left padding (masked out
    of every attention and of retrieval), or None without padding; packed: where a packed row's
    documents sit (training forward only), or None for one stream; scores: per group, every
    landmark's scores of every chunk [B, m, n] (training forward with retrieval targets only),
    else None.
    """

    memory: ChunkMemory
    caches: list[Any] | None
    slots: int = 0
    pending: torch.Tensor | None = None
    retrieval: list[CarriedRetrieval] | None = None
    record: RetrievalInfo | None = None
    pad: torch.Tensor | None = None
    packed: PackedLayout | None = None
    scores: list[torch.Tensor] | None = None

    @property
    def streaming(self) -> bool:
        return self.caches is not None
