"""The attention kinds a model config can name (`TransformerConfig(attention=...)`), in one table.

Every kind is an nn.Module class built from a model config (any object with the attributes it
reads) that maps x [B, T, d_model] -> [B, T, d_model] and decodes with a cache from
`new_cache()` that it updates in place: `forward(x, cache)` treats x as the positions that
follow what the cache holds. A class may declare `positions` (supported position encodings,
the first is the default) and `config_fields` (the config fields it requires, e.g. "window").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from farsight.errors import ConfigError
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
