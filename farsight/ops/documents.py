"""Packed rows: several documents laid end to end in one row, told apart by document ids.

farsight's one representation of document boundaries is `document_ids` [B, T], an integer per
token: the tokens of one document are consecutive and share an id, and the ids never decrease
along a row (0, 0, 0, 1, 1, 2, ...; the values themselves do not matter, only where they
change). Every op and model that takes `document_ids` lets a token see only the tokens of its
own document: attention, CASTLE's lookahead sums, DRT's retrieval and the loss (the last token of
a document predicts nothing). Per-token ids rather than `cu_seqlens` because each row of a batch
packs its own documents and every op masks [query, key] tiles: comparing two ids is the mask.

Hugging Face's padding-free convention (`position_ids` restarting at 0 inside a row, as
`DataCollatorWithFlattening` writes them) converts with `document_ids_from_positions`.
"""

from __future__ import annotations

import torch

from farsight.errors import InputError, InputTypeError


def check_document_ids(document_ids: object, shape: tuple[int, int], name: str = "document_ids") -> torch.Tensor:
    """Validate document ids for a [B, T] batch: an integer tensor of that shape whose ids never
    decrease along a row (each document's tokens are consecutive). Returns it as long."""
    if not isinstance(document_ids, torch.Tensor):
        raise InputTypeError(
            f"{name} must be a torch.Tensor of shape [batch, tokens], got {type(document_ids).__name__}"
        )
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise InputTypeError(
            f"{name} must be an integer tensor (one document id per token), got dtype {document_ids.dtype}"
        )
    if tuple(document_ids.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {list(shape)} (batch, tokens), got {list(document_ids.shape)}")
    document_ids = document_ids.long()
    # the value check reads the ids (a device sync); a compiled graph skips it rather than break
    # at every op: the model checked its ids once before its first block
    if torch.compiler.is_compiling():
        return document_ids
    if document_ids.shape[1] > 1 and bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise InputError(
            f"{name} decrease inside a row; each document's tokens must be consecutive with ids that never "
            "decrease along the row (e.g. 0 0 0 1 1 2)"
        )
    return document_ids


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] ids -> [B, T] bool, True at the first token of each document (column 0 included)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] ids -> [B, T] long: each token's position inside its document (0 at its first token)."""
    t = document_ids.shape[1]
    index = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    # the index of the latest document start at or before each token
    start = torch.where(document_starts(document_ids), index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face `position_ids` [B, T] -> document ids [B, T]: a document starts wherever the
    position restarts at 0 (the padding-free convention); one document when it never does."""
    restarts = position_ids == 0
    restarts[:, :1] = False
    return restarts.long().cumsum(dim=1)


def same_document(query_ids: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """query ids [B, Tq], key ids [B, Tk] -> [B, Tq, Tk] bool, True where query and key share a document."""
    return query_ids[:, :, None] == key_ids[:, None, :]


def single_document(document_ids: torch.Tensor | None) -> bool:
    """True when `document_ids` is None or every row holds one document (masking changes nothing).
    Inside a compiled graph only None counts: the ids are not read there (no graph break), and
    masking with one document per row computes the same."""
    if document_ids is None:
        return True
    if torch.compiler.is_compiling():
        return False
    return document_ids.shape[1] == 0 or bool((document_ids == document_ids[:, :1]).all())
