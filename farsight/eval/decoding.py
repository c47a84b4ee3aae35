"""Run any farsight LM over long inputs with bounded memory: DRT through its streaming session,
the transformers through their own caches, fed in blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from farsight.models import DRTForCausalLM, TransformerForCausalLM


class Decoder:
    """A uniform cached decoder: feed(ids [B, T]) -> logits after every token or after the last."""

    def feed(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def retrieved_chunks(self) -> list[set[int]] | None:
        """Per batch row, the chunks the current chunk retrieved (any group); None without retrieval."""
        return None

    def close(self) -> None:
        pass


class _DRTDecoder(Decoder):
    def __init__(self, model: DRTForCausalLM, batch_size: int, memory: str, path: str | None) -> None:
        self.session = model.new_session(batch_size=batch_size, memory=memory, path=path)

    def feed(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        return self.session.score(ids) if all_logits else self.session.prefill(ids)

    def retrieved_chunks(self) -> list[set[int]] | None:
        current = self.session.state.retrieval
        if not current:
            return None
        rows = torch.cat([index for index, _ in current], dim=1).tolist()
        return [{c for c in row if c >= 0} for row in rows]

    def close(self) -> None:
        self.session.close()


class _TransformerDecoder(Decoder):
    """Feeds blocks of `block` tokens through the KV caches (the sliding model's stay W long)."""

    def __init__(self, model: TransformerForCausalLM, block: int) -> None:
        self.model = model
        self.caches = model.new_caches()
        self.block = block

    def feed(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        outputs = []
        for start in range(0, ids.shape[1], self.block):
            logits = self.model(ids[:, start : start + self.block], caches=self.caches).logits
            outputs.append(logits if all_logits else logits[:, -1:])
        out = torch.cat(outputs, dim=1)
        return out if all_logits else out[:, -1]


@contextmanager
def open_decoder(
    model: Any, batch_size: int = 1, memory: str = "device", path: str | None = None, block: int = 2048
) -> Iterator[Decoder]:
    """Context manager giving a Decoder for `model` (eval mode, no grad inside)."""
    model.eval()
    if isinstance(model, DRTForCausalLM):
        decoder: Decoder = _DRTDecoder(model, batch_size, memory, path)
    elif isinstance(model, TransformerForCausalLM):
        decoder = _TransformerDecoder(model, block)
    else:
        raise TypeError(f"cannot decode a {type(model).__name__}; expected a farsight model")
    try:
        with torch.no_grad():
            yield decoder
    finally:
        decoder.close()


def greedy_continuation(
    decoder: Decoder,
    prompt: torch.Tensor,
    steps: int,
    on_tokens: Callable[[int], None] | None = None,
    block: int = 1 << 16,
) -> torch.Tensor:
    """Feed prompt [B, T] (in blocks, reporting each to `on_tokens`), then decode `steps` tokens
    greedily; returns them [B, steps]."""
    for start in range(0, prompt.shape[1], block):
        piece = prompt[:, start : start + block]
        logits = decoder.feed(piece)
        if on_tokens is not None:
            on_tokens(piece.shape[1])
    out = []
    for i in range(steps):
        token = logits.argmax(-1)
        out.append(token)
        if i + 1 < steps:
            logits = decoder.feed(token[:, None])
    return torch.stack(out, dim=1)
