"""Causal retrieval (GCA / DRT; Hu et al. 2025, docs/design.md §2) for any decoder stack.

`CausalRetrievalLM` turns a subclass's blocks into an LM that retrieves past chunks: it lays the
tokens out with a landmark slot after every chunk of S tokens, encodes each completed chunk into
a landmark key and the shared GCA keys/values, lets each of G groups of upper blocks read the K
earlier chunks that the previous chunk's landmark chose, and streams any length through
`new_session()` (chunk memory on the device, in host RAM or on disk). A subclass's `__init__`
registers, in this order (it fixes the parameter names and the initialisation):

    config          passed to `super().__init__(config)`: vocab_size, d_model, n_heads, head_dim,
                    norm_eps, n_layers and the retrieval fields `check_retrieval_config` checks
                    (chunk_size S, top_k K, groups G, ...)
    embed           slot ids [B, P] -> h [B, P, D]
    lower           blocks: block(h [B, P, D], cache, **masks) -> [B, P, D]
    add_retrieval(block_config)   the chunk encoder, landmark keys and per-group retrieval queries
    upper           G equal groups of blocks: block(h, cache, span, chunks, **masks) -> [B, P, D]
    norm, lm_head   the final norm and the LM head

`cache` is None in the training forward, else the block's decoding cache (`new_caches`); `masks`
holds `pad` [B] (the slots before pad[b] are left padding) and `document_ids` [B, P] (packed
rows), each only when there is one; `span` is the slots' `Span` on the chunk grid; `chunks` the
group's `FetchedChunks` (k, v [B, m, S, H, d]; index, weight [B, n, K]), or None when nothing is
retrieved. `RetrievalBlock` is such an upper block (self-attention, GCA, MLP). In return the
model has `forward(input_ids [B, L], labels) -> CausalLMOutput` (logits [B, L, V] of the real
tokens), `run_span(slots [B, P], state) -> h [B, P, D]` and `new_session()`.
examples/llama_retrieval.py adds retrieval to a Llama decoder this way; `DRTForCausalLM` is the
paper's model built from it.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from farsight.config import ConfigError, require
from farsight.errors import InputError
from farsight.layers import BidirectionalAttention, GroupedCrossAttention, RMSNorm, TransformerBlock, padding_mask
from farsight.models.chunk_memory import ChunkMemory
from farsight.models.drt_session import DRTSession
from farsight.models.drt_state import CarriedRetrieval, DRTState, FetchedChunks, PackedLayout, RetrievalInfo
from farsight.models.lm import CausalLMOutput, PretrainedLM, check_packed_input, checked_labels
from farsight.models.session import check_left_padding
from farsight.ops.documents import document_positions, document_starts
from farsight.ops.retrieval import add_neighbors, retrieval_scores, retrieval_target_loss, retrieval_topk

logger = logging.getLogger(__name__)

RETRIEVERS = ("learned", "random", "none")


def check_retrieval_config(config: Any) -> None:
    """Check the retrieval fields of a model config (ConfigError) and fill in their defaults:
    chunk_size, top_k, groups, neighbors_before and neighbors_after (0: the chunks read beside
    each retrieved one, docs/design.md §2.8), encoder_layers, lower_layers (None: n_layers //
    2), retriever (one of RETRIEVERS), gumbel, gumbel_temperature, softmax_one, landmark_id
    (None: the vocabulary's last id) and pad_id (None: 0 fills padding slots). A config's
    validate calls it once its head_dim is set (the chunk encoder's RoPE needs an even one)."""
    for name in ("chunk_size", "top_k", "groups"):
        value = getattr(config, name)
        require(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
    for name in ("neighbors_before", "neighbors_after"):
        value = getattr(config, name, 0)
        require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 0,
            f"{name} must be an integer >= 0 (the chunks read beside each retrieved one), got {value!r}",
        )
        setattr(config, name, value)
    require(config.encoder_layers >= 0, f"encoder_layers must be >= 0, got {config.encoder_layers}")
    if config.lower_layers is None:
        config.lower_layers = config.n_layers // 2
    upper = config.n_layers - config.lower_layers
    require(
        0 <= config.lower_layers < config.n_layers,
        f"lower_layers must be in [0, n_layers) so that some upper layers carry GCA, got {config.lower_layers}",
    )
    require(
        upper % config.groups == 0,
        f"the {upper} upper layers cannot be split into groups={config.groups} of equal size; "
        "choose groups dividing n_layers - lower_layers",
    )
    require(config.head_dim % 2 == 0, f"head_dim must be even (the chunk encoder uses RoPE), got {config.head_dim}")
    require(config.retriever in RETRIEVERS, f"retriever must be one of {list(RETRIEVERS)}, got {config.retriever!r}")
    require(config.gumbel_temperature > 0, f"gumbel_temperature must be > 0, got {config.gumbel_temperature}")
    if config.landmark_id is None:
        config.landmark_id = config.vocab_size - 1
    require(
        0 <= config.landmark_id < config.vocab_size,
        f"landmark_id={config.landmark_id} is outside the vocabulary [0, {config.vocab_size})",
    )
    if config.pad_id is not None:
        require(
            0 <= config.pad_id < config.vocab_size,
            f"pad_id={config.pad_id} is outside the vocabulary [0, {config.vocab_size})",
        )


def set_retrieval_top_k(model: Any, top_k: int) -> int:
    """Have a retrieval model (a `CausalRetrievalLM`, e.g. a DRT) read `top_k` past chunks per
    query chunk from now on, instead of the K it was trained with; returns the K it had.

    The retriever ranks every past chunk the same way whatever K is; K only says how many of
    the best GCA reads and blends (the weights are a softmax over the K scores, docs/design.md §2.3-2.4). An
    evaluation may therefore read fewer chunks than training did, where a blend of K chunks
    misreads the one chunk that holds the answer. The new K is part of the model's config: a
    model saved afterwards keeps it. InputError for a model without retrieval or a K that is not
    a whole number >= 1."""
    _require_retrieval(model, "retrieval top-k")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise InputError(f"retrieval top-k must be a whole number >= 1, got {top_k!r}")
    trained, model.config.top_k = model.config.top_k, int(top_k)
    if top_k != trained:
        logger.info(f"retrieving {top_k} chunks per query chunk (the model's config had {trained})")
    return trained


def _require_retrieval(model: Any, option: str) -> None:
    if not isinstance(model, CausalRetrievalLM):
        kind = getattr(model, "model_type", type(model).__name__)
        raise InputError(
            f"{option} applies to models with causal retrieval (DRT); this is a {kind!r} model; drop the option"
        )


def parse_neighbors(value: Any) -> tuple[int, int]:
    """The chunks read beside each retrieved one, as (before, after), from N (N on each side),
    (BEFORE, AFTER), or the text "N" / "BEFORE:AFTER"; InputError naming the accepted forms."""
    parts = value.split(":") if isinstance(value, str) else value
    if isinstance(parts, (list, tuple)) and len(parts) == 1:
        parts = parts[0]
    if not isinstance(parts, (list, tuple)):
        parts = (parts, parts)
    try:
        before, after = (int(p, 10) if isinstance(p, str) else p for p in parts)
    except ValueError:
        before = after = None
    if len(parts) != 2 or not all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in (before, after)
    ):
        raise InputError(
            f"retrieval neighbors must be N (N chunks on each side) or BEFORE:AFTER, whole numbers >= 0, got {value!r}"
        )
    return int(before), int(after)


def set_retrieval_neighbors(model: Any, neighbors: Any) -> tuple[int, int]:
    """Have a retrieval model read, beside each chunk it retrieves, the chunks just before and
    after it (`parse_neighbors`: N, (BEFORE, AFTER) or "BEFORE:AFTER"); returns the (before,
    after) it had. Evidence that straddles a chunk boundary is then read whole once either of
    its chunks is retrieved (docs/design.md §2.8). Like top-k, the setting is part of the
    model's config: a model saved afterwards keeps it. InputError for a model without retrieval
    or a malformed value."""
    _require_retrieval(model, "retrieval neighbors")
    before, after = parse_neighbors(neighbors)
    config = model.config
    had = (config.neighbors_before, config.neighbors_after)
    config.neighbors_before, config.neighbors_after = before, after
    if (before, after) != had:
        logger.info(
            f"reading {before} chunk(s) before and {after} after each retrieved one (the model's config had {had})"
        )
    return had


@dataclass
class Span:
    """Where a span of slots [start, start + length) sits on the chunk grid."""

    start: int
    length: int
    slots_per_chunk: int
    first_chunk: int = field(init=False)
    n_chunks: int = field(init=False)
    pad_left: int = field(init=False)
    pad_right: int = field(init=False)

    def __post_init__(self) -> None:
        s1 = self.slots_per_chunk
        self.first_chunk = self.start // s1
        last = (self.start + self.length - 1) // s1
        self.n_chunks = last - self.first_chunk + 1
        self.pad_left = self.start - self.first_chunk * s1
        self.pad_right = self.n_chunks * s1 - self.pad_left - self.length

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[B, length, *rest] -> [B, n_chunks, S+1, *rest] (zeros outside the span)."""
        if self.pad_left or self.pad_right:
            pad = [0, 0] * (x.dim() - 2) + [self.pad_left, self.pad_right]
            x = F.pad(x, pad)
        return x.reshape(x.shape[0], self.n_chunks, self.slots_per_chunk, *x.shape[2:])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], self.n_chunks * self.slots_per_chunk, *x.shape[3:])
        return x[:, self.pad_left : self.pad_left + self.length]

    def landmark_positions(self) -> tuple[torch.Tensor, int]:
        """Offsets (within the span) of the landmark slots, and the chunk id of the first one."""
        s1 = self.slots_per_chunk
        first = self.first_chunk * s1 + s1 - 1 - self.start
        return torch.arange(first, max(first, self.length), s1), self.first_chunk


@dataclass
class Retrieval:
    """One group's retrieval over a span: index/weight [B, n_grid, K] (what each chunk of the
    span's grid reads; -1 empty) and made_index/made_weight [B, m, K] (the retrievals made by
    the span's m landmarks, None when the span holds no landmark)."""

    index: torch.Tensor
    weight: torch.Tensor
    made_index: torch.Tensor | None
    made_weight: torch.Tensor | None


class RetrievalBlock(TransformerBlock):
    """Upper block: x += attn(norm x); x += GCA(norm x); x += MLP(norm x), the attention of
    `block_config`'s kind (DRT: the sliding window; a Llama: causal)."""

    def __init__(self, block_config: Any, softmax_one: bool = True) -> None:
        super().__init__(block_config)
        c = block_config
        self.cross_norm = RMSNorm(c.d_model, c.norm_eps)
        self.cross = GroupedCrossAttention(c.d_model, c.n_heads, c.head_dim, softmax_one)

    def forward(
        self,
        x: torch.Tensor,
        cache: Any = None,
        span: Span | None = None,
        chunks: FetchedChunks | None = None,
        **masks: Any,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, **masks)
        if chunks is not None:
            grid = span.to_grid(self.cross_norm(x))
            attended = self.cross(grid, chunks.k, chunks.v, chunks.index, chunks.weight, chunks.key_mask)
            x = x + span.from_grid(attended)
        return x + self.mlp(self.mlp_norm(x))


class CausalRetrievalLM(PretrainedLM):
    """A causal LM whose upper blocks read retrieved past chunks; see the module docstring for
    what a subclass registers."""

    @classmethod
    def config_defaults(cls, tokenizer: Any) -> dict[str, Any]:
        return {"vocab_size": tokenizer.vocab_size, "landmark_id": tokenizer.lmk_id, "pad_id": tokenizer.pad_id}

    @classmethod
    def check_tokenizer(cls, config: Any, tokenizer: Any) -> None:
        """The landmark slot must not share an id with a token the data holds (eos/bos/pad)."""
        for name in ("eos", "bos", "pad"):
            if config.landmark_id == getattr(tokenizer, f"{name}_id"):
                raise ConfigError(
                    f"model.landmark_id={config.landmark_id} is the tokenizer's {name} id; landmarks need an id "
                    f"of their own — remove model.landmark_id (the tokenizer's lmk id {tokenizer.lmk_id} is used)"
                )

    def add_retrieval(self, block_config: Any) -> None:
        """Register the retrieval modules: the chunk encoder (config.encoder_layers bidirectional
        blocks of `block_config`'s sizes, RoPE inside the chunk) and its norm, the shared GCA K/V
        projection `chunk_kv`, the landmark keys' W_l `landmark_key`, and per group the query's
        norm and W_h (`query_norms`, `query_proj`; docs/design.md §2.2-2.3)."""
        config = self.config
        d, inner = config.d_model, config.n_heads * config.head_dim
        encoder_config = block_config.replace(attention="causal", window=None, position="rope")
        self.encoder = nn.ModuleList(
            TransformerBlock(encoder_config, BidirectionalAttention(encoder_config))
            for _ in range(config.encoder_layers)
        )
        self.encoder_norm = RMSNorm(d, config.norm_eps)
        self.chunk_kv = nn.Linear(d, 2 * inner, bias=False)
        self.landmark_key = nn.Linear(d, d, bias=False)
        self.query_norms = nn.ModuleList(RMSNorm(d, config.norm_eps) for _ in range(config.groups))
        self.query_proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(config.groups))

    @property
    def slots_per_chunk(self) -> int:
        return self.config.chunk_size + 1

    def layers(self) -> list[nn.Module]:
        return [*self.lower, *self.upper]

    def new_caches(self) -> list[Any]:
        """One decoding cache per block of `layers()`: its attention's `new_cache()`. A session
        snapshots them with copy.copy (to undo a failed call), so a copy must keep what the
        cache held when it was taken."""
        return [block.attn.new_cache() for block in self.layers()]

    def reserved_ids(self) -> dict[str, int]:
        return {"landmark": self.config.landmark_id}

    # ---- stream layout ------------------------------------------------------------------------
    def to_slots(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids -> [B, n (S+1)] slots: right-padded to whole chunks, a LMK after each."""
        b, length = input_ids.shape
        s = self.config.chunk_size
        n = max(1, math.ceil(length / s))
        pad_id = self.config.pad_id if self.config.pad_id is not None else 0
        ids = F.pad(input_ids, (0, n * s - length), value=pad_id).view(b, n, s)
        lmk = ids.new_full((b, n, 1), self.config.landmark_id)
        return torch.cat([ids, lmk], dim=2).view(b, n * (s + 1))

    def packed_slots(self, input_ids: torch.Tensor, document_ids: torch.Tensor) -> tuple[torch.Tensor, PackedLayout]:
        """A packed row [B, L] with its document ids -> (slots [B, n (S+1)], layout): each
        document laid out as `to_slots` lays out a row of its own — from a chunk boundary, its
        last chunk right-padded, a landmark after every chunk — and the documents of a row end to
        end. A chunk is the unit of retrieval (one landmark summarises it, one retrieval serves
        all its tokens), so a chunk holding the end of one document and the start of the next
        would let each read the other; the price is under S padding slots per document."""
        b, length = input_ids.shape
        s, s1 = self.config.chunk_size, self.slots_per_chunk
        position = document_positions(document_ids)  # [B, L] place inside the document
        ordinal = document_starts(document_ids).long().cumsum(1) - 1  # [B, L] document's place in its row
        sizes = torch.zeros(b, length, dtype=torch.long, device=input_ids.device)
        sizes.scatter_add_(1, ordinal, torch.ones_like(ordinal))  # tokens per document
        chunks = (sizes + s - 1) // s
        chunk_offset = chunks.cumsum(1) - chunks  # the first chunk of each document
        token_chunk = chunk_offset.gather(1, ordinal) + position // s  # [B, L]
        n = max(1, int(chunks.sum(1).max()))
        token_slots = token_chunk * s1 + position % s
        pad_id = self.config.pad_id if self.config.pad_id is not None else 0
        slots = input_ids.new_full((b, n, s1), pad_id)
        slots[:, :, s] = self.config.landmark_id
        slots = slots.view(b, n * s1).scatter(1, token_slots, input_ids)
        # chunks after the row's last document: one more id, so the ids still never decrease
        tail = document_ids.max() + 1 if length else document_ids.new_zeros(())
        chunk_documents = tail.expand(b, n).clone().scatter_(1, token_chunk, document_ids)  # [B, n]
        index = torch.arange(n, device=input_ids.device)
        first_chunk = index - document_positions(chunk_documents)
        slot_documents = chunk_documents.repeat_interleave(s1, dim=1)
        return slots, PackedLayout(token_slots, slot_documents, first_chunk)

    def real_rows(self, h: torch.Tensor, length: int) -> torch.Tensor:
        """Slot-stream rows [B, n (S+1), ...] -> the rows of the first `length` real tokens."""
        b, n = h.shape[0], h.shape[1] // self.slots_per_chunk
        rows = h.view(b, n, self.slots_per_chunk, *h.shape[2:])[:, :, : self.config.chunk_size]
        return rows.reshape(b, n * self.config.chunk_size, *h.shape[2:])[:, :length]

    # ---- left padding (docs/design.md §2.1: inference prompts end on a chunk boundary) ----------
    def pad_slots(self, lead: torch.Tensor) -> torch.Tensor | None:
        """lead [B] left-padding tokens per row -> the slots they fill (a whole chunk of padding
        takes its landmark slot too), or None when no row is padded: DRTState.pad."""
        if not bool(lead.any()):
            return None
        s = self.config.chunk_size
        return lead // s * (s + 1) + lead % s

    def _retrieved_key_mask(self, index: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor | None:
        """index [B, n, K] retrieved chunk ids -> GCA key mask [B, n, K, S] (True = real key), or
        None when no retrieved chunk holds padding (only the first real chunk of a prompt can)."""
        if pad is None:
            return None
        s1 = self.slots_per_chunk
        slots = index[..., None] * s1 + torch.arange(self.config.chunk_size, device=index.device)
        mask = (slots >= pad[:, None, None, None]) | (index[..., None] < 0)
        return None if bool(mask.all()) else mask

    # ---- pieces of the span forward ------------------------------------------------------------
    def encode_chunks(
        self, rows: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows [B, m, S+1, D] lower-layer outputs of m whole chunks -> (landmark keys [B, m, D],
        k [B, m, S, H, d], v [B, m, S, H, d]). Each chunk is encoded on its own;
        key_padding_mask [B, m, S+1] (True = real slot) hides left padding inside a chunk."""
        b, m, s1, d = rows.shape
        x = rows.reshape(b * m, s1, d)
        masks = {} if key_padding_mask is None else {"key_padding_mask": key_padding_mask.reshape(b * m, s1)}
        for block in self.encoder:
            x = self.run_block(block, x, **masks)  # [B m, S+1, D]
        x = self.encoder_norm(x).view(b, m, s1, d)
        kv = self.chunk_kv(x[:, :, :-1]).view(b, m, s1 - 1, 2, self.config.n_heads, self.config.head_dim)
        return self.landmark_key(x[:, :, -1]), kv[:, :, :, 0], kv[:, :, :, 1]

    def _select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [B, m, n] (-inf = not a candidate) -> (index [B, m, K] with -1 for empty, weight [B, m, K]):
        the top K of the scores, with Gumbel noise in training, or K random candidates."""
        take = min(self.config.top_k, scores.shape[-1])
        if self.config.retriever == "random":
            noise = torch.rand(scores.shape, device=scores.device)
            key = noise.masked_fill(~torch.isfinite(scores), float("-inf"))
        elif self.config.gumbel and self.training:
            uniform = torch.rand(scores.shape, device=scores.device).clamp(1e-20, 1 - 1e-7)
            key = scores.detach() / self.config.gumbel_temperature - torch.log(-torch.log(uniform))
        else:
            key = scores.detach()
        top = key.topk(take, dim=-1).indices
        return self._weigh(top, scores.gather(-1, top))

    def _weigh(self, top: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """top [B, m, k <= K] chosen chunk ids and their scores (-inf = empty) -> (index [B, m, K]
        with -1 for empty, softmax weight [B, m, K] over the chosen scores)."""
        valid = torch.isfinite(chosen)
        # finite stand-in for empty slots keeps softmax (and its backward) free of NaN
        weight = torch.softmax(torch.where(valid, chosen, torch.full_like(chosen, -1e9)), dim=-1) * valid
        index = torch.where(valid, top, torch.full_like(top, -1))
        missing = self.config.top_k - top.shape[-1]
        if missing:
            index = F.pad(index, (0, missing), value=-1)
            weight = F.pad(weight, (0, missing))
        return index, weight

    # ---- the span forward, step by step -----------------------------------------------------
    @staticmethod
    def _masks(state: DRTState) -> dict[str, torch.Tensor]:
        """The masks every decoder block takes (module docstring): only those the span has."""
        masks = {} if state.pad is None else {"pad": state.pad}
        if state.packed is not None:
            masks["document_ids"] = state.packed.slot_documents
        return masks

    def _lower_layers(self, h: torch.Tensor, state: DRTState) -> torch.Tensor:
        masks = self._masks(state)
        for i, block in enumerate(self.lower):
            # streaming caches are appended to in the forward: only the cacheless forward is checkpointed
            h = block(h, state.caches[i], **masks) if state.streaming else self.run_block(block, h, None, **masks)
        return h

    def _append_completed_chunks(self, h: torch.Tensor, state: DRTState) -> None:
        """Encode the chunks the span completes (with the rows pending from earlier spans) into
        the memory; keep the rows of a chunk still incomplete when streaming."""
        rows = h if state.pending is None else torch.cat([state.pending, h], dim=1)
        s1 = self.slots_per_chunk
        complete = rows.shape[1] // s1
        if complete:
            first = state.memory.n_chunks
            mask = padding_mask(state.pad, first * s1, (first + complete) * s1)
            mask = None if mask is None else mask.view(h.shape[0], complete, s1)
            state.memory.append(*self.encode_chunks(rows[:, : complete * s1].view(h.shape[0], complete, s1, -1), mask))
        state.pending = rows[:, complete * s1 :] if state.streaming else None

    @property
    def reads_per_retrieval(self) -> int:
        """Chunks a retrieval hands GCA: the top K, each with its neighbors (docs/design.md §2.8)."""
        return self.config.top_k * (1 + self.config.neighbors_before + self.config.neighbors_after)

    def _empty_retrieval(self, h: torch.Tensor) -> CarriedRetrieval:
        k = self.reads_per_retrieval
        empty = torch.full((h.shape[0], k), -1, dtype=torch.long, device=h.device)
        return CarriedRetrieval(
            empty, torch.zeros(h.shape[0], k, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        )

    def _retrieve(
        self,
        group: int,
        h: torch.Tensor,
        span: Span,
        carried: CarriedRetrieval,
        memory: ChunkMemory,
        pad: torch.Tensor | None,
        packed: PackedLayout | None = None,
        kept: list[torch.Tensor] | None = None,
    ) -> Retrieval:
        """What each chunk of the span reads for `group`: grid chunk 0 reads the carried
        retrieval, chunk j > 0 the one made by the landmark of chunk j - 1. In a packed row a
        landmark scores only the earlier chunks of its own document, and a document's first
        chunk reads nothing. `kept`, if given, receives the landmarks' scores of every chunk
        [B, m, n] (-inf = no candidate)."""
        offsets, first_chunk = span.landmark_positions()
        made_index = made_weight = None
        if len(offsets):
            query = self.query_proj[group](self.query_norms[group](h[:, offsets.to(h.device)]))  # [B, m, D]
            # chunk first_chunk + i retrieves among chunks [start, first_chunk + i): those before
            # start[b] hold nothing but left padding
            stop = first_chunk + torch.arange(len(offsets), device=h.device)
            start = (
                torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
                if pad is None
                else pad // self.slots_per_chunk
            )
            scale = 1 / math.sqrt(self.config.d_model)
            # Gumbel noise, random keys and supervised retrieval need every score
            if packed is not None or self.training or self.config.retriever == "random" or kept is not None:
                scores = retrieval_scores(query, memory.landmark_keys(), start, stop, scale)  # [B, m, n]
                if packed is not None:
                    # chunks before the first chunk of the landmark's document are no candidates
                    earlier = (
                        torch.arange(scores.shape[-1], device=h.device) < packed.first_chunk[:, : len(offsets), None]
                    )
                    scores = scores.masked_fill(earlier, float("-inf"))
                if kept is not None:
                    kept.append(scores)
                made_index, made_weight = self._select(scores)
            else:
                top, chosen = retrieval_topk(
                    query, memory.landmark_keys(), self.config.top_k, start, stop, scale, **memory.screen_state()
                )
                made_index, made_weight = self._weigh(top, chosen)
            if self.config.neighbors_before or self.config.neighbors_after:
                low = start[:, None].expand(-1, len(offsets))
                if packed is not None:
                    low = torch.maximum(low, packed.first_chunk[:, : len(offsets)])
                made_index, made_weight = add_neighbors(
                    made_index,
                    made_weight,
                    self.config.neighbors_before,
                    self.config.neighbors_after,
                    low,
                    stop.expand(h.shape[0], -1),
                )
        index, weight = carried.index[:, None], carried.weight[:, None]
        if span.n_chunks > 1:
            index = torch.cat([index, made_index[:, : span.n_chunks - 1]], dim=1)
            weight = torch.cat([weight, made_weight[:, : span.n_chunks - 1]], dim=1)
        if packed is not None:
            # [B, n, 1]: a document's first chunk would read the previous document's last retrieval
            first = (packed.first_chunk == torch.arange(span.n_chunks, device=h.device))[..., None]
            index = index.masked_fill(first, -1)
            weight = weight.masked_fill(first, 0.0)
        return Retrieval(index, weight, made_index, made_weight)

    def _fetch(
        self, retrieval: Retrieval, carried: CarriedRetrieval, memory: ChunkMemory, pad: torch.Tensor | None
    ) -> FetchedChunks | None:
        """The retrieved chunks' K/V from the memory tier (None when nothing is retrieved). A span
        inside one chunk reads the carried retrieval: its chunks are fetched once and kept."""
        if retrieval.index.shape[1] == 1 and carried.fetched is not None:
            return carried.fetched
        if not bool((retrieval.index >= 0).any()):
            return None
        k, v, index = memory.fetch(retrieval.index)
        chunks = FetchedChunks(k, v, index, retrieval.weight, self._retrieved_key_mask(retrieval.index, pad))
        if retrieval.index.shape[1] == 1:
            carried.fetched = chunks
        return chunks

    def _upper_group(
        self, group: int, h: torch.Tensor, state: DRTState, span: Span, chunks: FetchedChunks | None
    ) -> torch.Tensor:
        per_group = len(self.upper) // self.config.groups
        masks = self._masks(state)
        for j in range(group * per_group, (group + 1) * per_group):
            if state.streaming:
                h = self.upper[j](h, state.caches[len(self.lower) + j], span, chunks, **masks)
            else:
                # chunks' K/V [B, n, S, H, d] are autograd tensors of the chunk encoder: the
                # non-reentrant checkpoint backpropagates into them although they sit in a dataclass
                h = self.run_block(self.upper[j], h, None, span, chunks, **masks)
        return h

    def _carry(
        self,
        retrieval: Retrieval,
        carried: CarriedRetrieval,
        chunks: FetchedChunks | None,
        span: Span,
        slots_after: int,
    ) -> CarriedRetrieval:
        """The retrieval the chunk after the span reads: the one its last landmark made if the
        span ended with a landmark, else the one its last chunk reads (with its chunks, fetched)."""
        if slots_after // self.slots_per_chunk == span.first_chunk + span.n_chunks:
            return CarriedRetrieval(retrieval.made_index[:, -1], retrieval.made_weight[:, -1])
        if span.n_chunks == 1:
            return carried
        last = None
        if chunks is not None:
            key_mask = None if chunks.key_mask is None else chunks.key_mask[:, -1:]
            last = FetchedChunks(chunks.k, chunks.v, chunks.index[:, -1:], chunks.weight[:, -1:], key_mask)
        return CarriedRetrieval(retrieval.index[:, -1], retrieval.weight[:, -1], last)

    def run_span(self, slot_ids: torch.Tensor, state: DRTState) -> torch.Tensor:
        """Slots [B, P] continuing `state` -> final hidden states [B, P, D] (before the final norm):
        the lower blocks, the chunks the span completes into the memory, then per group: retrieve,
        fetch, the group's upper blocks.

        Updates `state` in place so the next span continues the stream.
        """
        span = Span(state.slots, slot_ids.shape[1], self.slots_per_chunk)
        h = self._lower_layers(self.embed(slot_ids), state)
        if self.config.retriever == "none":
            for g in range(self.config.groups):
                h = self._upper_group(g, h, state, span, None)
        else:
            self._append_completed_chunks(h, state)
            carried = state.retrieval or [self._empty_retrieval(h) for _ in range(self.config.groups)]
            next_carried = []
            for g in range(self.config.groups):
                retrieval = self._retrieve(g, h, span, carried[g], state.memory, state.pad, state.packed, state.scores)
                chunks = self._fetch(retrieval, carried[g], state.memory, state.pad)
                h = self._upper_group(g, h, state, span, chunks)
                next_carried.append(self._carry(retrieval, carried[g], chunks, span, state.slots + span.length))
                if state.record is not None and retrieval.made_index is not None:
                    state.record.indices.append(retrieval.made_index)
                    state.record.weights.append(retrieval.made_weight)
            state.retrieval = next_carried
        state.slots += span.length
        return h

    # ---- public API ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        return_retrieval: bool = False,
        attention_mask: torch.Tensor | None = None,
        return_logits: bool = True,
        return_hidden: bool = False,
        document_ids: torch.Tensor | None = None,
        retrieval_targets: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, L] plain token ids (any L) -> logits [B, L, V] for the real tokens.

        Landmarks are inserted here and the last chunk is right-padded; neither appears in the
        logits or the loss. attention_mask [B, L] (0 = left padding, then 1s; HF convention)
        masks the padding out of every attention and of retrieval; the chunk grid starts at the
        first column either way, and the logits at padding positions are meaningless. With
        return_retrieval, `retrieval` is a RetrievalInfo (row t of each group: the chunks
        retrieved by chunk t's landmark, used by chunk t+1). return_logits=False (with labels):
        the loss alone, logits None (`logits_and_loss`). return_hidden: the final norm's output
        [B, L, D] for the real tokens as `hidden` instead (no head, no loss). document_ids
        [B, L] (packed rows, farsight.ops.documents): each document is laid out on the chunk grid
        as if alone (`packed_slots`), attends and retrieves only inside itself, and its last
        token predicts nothing. retrieval_targets [B, L] (integers; 1: a token of the evidence,
        2: a token whose chunk's retrieval should find the evidence, 0: neither; a row that asks
        about several needles numbers them: 2p + 1 and 2p + 2 for its needle p; the needle
        batches' `data.retrieval_weight`) adds supervised retrieval: `retrieval_loss` and
        `retrieval_found` (`supervised_retrieval`).
        """
        input_ids = self.check_input_ids(input_ids)
        document_ids = check_packed_input(input_ids, document_ids, attention_mask=attention_mask)
        labels = checked_labels(labels, document_ids, self.config.vocab_size)
        length = input_ids.shape[1]
        empty = self.empty_output(input_ids, labels, loss_weights, return_logits)
        if empty is not None:
            if attention_mask is not None:
                check_left_padding(attention_mask, input_ids)
            return empty if not return_retrieval else CausalLMOutput(empty.loss, empty.logits, RetrievalInfo([], []))
        pad = None
        if attention_mask is not None:
            pad = self.pad_slots((~check_left_padding(attention_mask, input_ids).to(input_ids.device)).sum(1))
        record = RetrievalInfo([], []) if return_retrieval else None
        state = DRTState(memory=ChunkMemory("graph", input_ids.device), caches=None, record=record, pad=pad)
        if retrieval_targets is not None:
            retrieval_targets = self._check_retrieval_targets(retrieval_targets, input_ids)
            state.scores = []
        if document_ids is None:
            h = self.real_rows(self.run_span(self.to_slots(input_ids), state), length)
        else:
            slots, state.packed = self.packed_slots(input_ids, document_ids)
            h = self.run_span(slots, state)
            h = h.gather(1, state.packed.token_slots[..., None].expand(-1, -1, h.shape[-1]))
        supervised = {}
        if retrieval_targets is not None:
            supervised = self.supervised_retrieval(retrieval_targets, state)
        if return_hidden:
            return CausalLMOutput(loss=None, logits=None, retrieval=record, hidden=self.norm(h), **supervised)
        logits, loss = self.logits_and_loss(h, labels, loss_weights, return_logits)
        return CausalLMOutput(loss=loss, logits=logits, retrieval=record if return_retrieval else None, **supervised)

    def _check_retrieval_targets(self, targets: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor) or targets.shape != input_ids.shape:
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise InputError(
                f"retrieval_targets must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got {shape}"
            )
        if (
            targets.is_floating_point()
            or targets.is_complex()
            or targets.dtype == torch.bool
            or bool((targets < 0).any())
        ):
            raise InputError(
                "retrieval_targets holds 0 (neither), 1 (evidence) or 2 (a token whose retrieval should find it) as integers, "
                "or 2p + 1 and 2p + 2 for a row's needle p"
            )
        if self.config.retriever != "learned":
            raise InputError(
                f"retrieval_targets supervise a learned retriever; this model's retriever is {self.config.retriever!r}"
            )
        return targets.to(input_ids.device, torch.long)  # int64: (needle, chunk) slots overflow narrower ints

    def supervised_retrieval(self, targets: torch.Tensor, state: DRTState) -> dict[str, torch.Tensor]:
        """targets [B, L] (forward's retrieval_targets) and the scores a training forward kept ->
        {"retrieval_loss": the mean over groups of `retrieval_target_loss` per supervised
        retrieval, "retrieval_found": the share of supervised retrievals whose top k held the
        evidence's chunks (nan when none was supervised)}. A token of chunk c reads the retrieval
        made by the landmark of chunk c - 1, so that retrieval is the one supervised, toward the
        chunks of the evidence of the needle its tokens ask about (of each, where answers about
        two needles share a chunk)."""
        b, length = targets.shape
        s, s1 = self.config.chunk_size, self.slots_per_chunk
        if state.packed is None:
            chunk = (torch.arange(length, device=targets.device) // s).expand(b, length)
        else:
            chunk = state.packed.token_slots // s1
        if not state.scores:  # no landmark, hence no retrieval
            zero = torch.zeros((), device=targets.device)
            return {"retrieval_loss": zero, "retrieval_found": zero / zero}
        m, n = state.scores[0].shape[-2:]
        needles = max(1, (int(targets.max()) + 1) // 2)  # targets 2p + 1 (evidence) and 2p + 2 (asking) of needle p
        slot = (targets - 1).clamp(min=0).div(2, rounding_mode="floor") * (n + 1) + chunk  # [B, L]: (needle, chunk)
        counts = torch.zeros(2, b, needles * (n + 1), dtype=torch.long, device=targets.device)
        counts[0].scatter_add_(1, slot, (targets % 2 == 1).long())
        counts[1].scatter_add_(1, slot, ((targets > 0) & (targets % 2 == 0)).long())
        counts = counts.view(2, b, needles, n + 1)
        evidence = counts[0, :, :, :n] > 0  # [B, P, n]: the chunks holding needle p's evidence
        asking = counts[1, :, :, 1 : m + 1] > 0  # [B, P, m]: landmark i serves chunk i + 1
        # [B, m, n]: the chunks each retrieval should find, those of the needles its chunk asks about
        evidence = torch.einsum("bpm,bpn->bmn", asking.float(), evidence.float()) > 0
        asking = asking.any(1)
        losses, counted, found = [], 0, 0
        for scores in state.scores:
            loss, n_counted, n_found = retrieval_target_loss(scores, asking, evidence, self.config.top_k)
            losses.append(loss / n_counted.clamp(min=1))
            counted, found = counted + n_counted, found + n_found
        return {"retrieval_loss": torch.stack(losses).mean(), "retrieval_found": found / counted}

    def new_session(
        self,
        batch_size: int = 1,
        memory: str = "device",
        path: str | os.PathLike | None = None,
        segment_chunks: int = 64,
        record_retrieval: bool = False,
        kv_dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
    ) -> DRTSession:
        """A streaming session (farsight.models.drt_session.DRTSession): chunk memory in `memory`
        ("device", "host" or "disk" at `path`, a new file unless `overwrite`) with K/V stored in
        `kv_dtype` (default: the compute dtype), long inputs run `segment_chunks` chunks per span."""
        return DRTSession(self, batch_size, memory, path, segment_chunks, record_retrieval, kv_dtype, overwrite)
