"""Greedy answers from any farsight LM through its Session, the prompt fed in blocks so a long
prompt streams with bounded memory and reports its progress."""

from __future__ import annotations

from collections.abc import Callable

import torch

from farsight.models import Session


def greedy_continuation(
    session: Session,
    prompt: torch.Tensor,
    steps: int,
    on_tokens: Callable[[int], None] | None = None,
    block: int = 1 << 16,
    lead_in: torch.Tensor | None = None,
    aligned: bool = True,
) -> torch.Tensor:
    """Prefill prompt [B, T] (in blocks, reporting each to `on_tokens`), feed lead_in [B, t] if
    given (tokens that follow the aligned prompt, e.g. the needle tasks' " is"), then decode
    `steps` tokens greedily; returns them [B, steps]. aligned=False feeds the prompt without the
    session's alignment padding (DRT: the prompt's end stays wherever it falls in its chunk)."""

    def blocks():
        for start in range(0, prompt.shape[1], block):
            yield prompt[:, start : start + block]
            if on_tokens is not None:
                on_tokens(min(block, prompt.shape[1] - start))

    logits = session.prefill(blocks(), length=prompt.shape[1] if aligned else None)
    if lead_in is not None and lead_in.shape[1]:
        logits = session.feed(lead_in)[:, -1]
    out = []
    for i in range(steps):
        token = logits.argmax(-1)
        out.append(token)
        if i + 1 < steps:
            logits = session.step(token)
    return torch.stack(out, dim=1)
