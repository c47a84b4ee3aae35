"""The attention kinds a model config can name (`TransformerConfig(attention=...)`), in one table.

Every kind is an nn.Module class built from a model config (any object with the attributes it
reads) that maps x [B, T, d_model] -> [B, T, d_model] and decodes with a cache from
`new_cache()` that it updates in place: `forward(x, cache)` treats x as the positions that
follow what the cache holds. A class may declare `positions` (supported position encodings,
the first is the default) and `config_fields` (the config fields it requires, e.g. "window").
A kind that trains on packed rows takes `forward(x, None, document_ids=...)` ([B, T] document
ids, farsight.ops.documents) and lets each token attend only to its own document; every
built-in kind does. A kind in a causal-retrieval model (farsight.models.causal_retrieval) also
takes `pad` [B] (the positions before pad[b] are left padding, hidden from every query but their
own); the causal and sliding kinds do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from farsight.errors import ConfigError, InputError
from farsight.layers.attention import CausalSelfAttention, SlidingWindowAttention
from farsight.layers.castle import CastleAttention, CastleSWLAttention

ATTENTION_KINDS: dict[str, type[nn.Module]] = {
    "causal": CausalSelfAttention,
    "sliding": SlidingWindowAttention,
    "castle": CastleAttention,
    "castle-swl": CastleSWLAttention,
}


def register_attention(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator for a user's own attention kind: adds it to ATTENTION_KINDS under each of
    `names`, so that `TransformerConfig(attention=name)` builds it."""

    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            ATTENTION_KINDS[name] = cls
        return cls

    return decorate


def build_attention(config: Any) -> nn.Module:
    """The attention module of kind `config.attention`, built from `config`."""
    try:
        cls = ATTENTION_KINDS[config.attention]
    except KeyError:
        raise ConfigError(
            f"unknown attention kind {config.attention!r}; choose one of {sorted(ATTENTION_KINDS)}"
        ) from None
    return cls(config)


def check_takes_documents(attention: nn.Module, kind: str) -> None:
    """Refuse packed rows (document_ids) for an attention kind whose forward does not take them."""
    if "document_ids" not in inspect.signature(attention.forward).parameters:
        raise InputError(
            f"attention kind {kind!r} ({type(attention).__name__}) does not take document_ids, so it cannot "
            "train on packed rows: add a document_ids argument to its forward or turn data.pack off"
        )
