"""Sampling and the autoregressive loop, written once for every model on the Session protocol."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from farsight.errors import InputError, InputTypeError

if TYPE_CHECKING:
    from farsight.models.session import Session


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy decoding."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    # shifted so that each row's largest logit is 0: a tiny temperature then sends the others to
    # -inf rather than the largest to inf (inf - inf is NaN in the softmax)
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    try:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    except RuntimeError as exc:  # found where the draw needs the probabilities anyway: no extra sync per token
        raise InputError(
            "the model's next-token logits are NaN or all -inf (an overflow, e.g. fp16 weights out of range); "
            "run the model in fp32 or bf16"
        ) from exc


def _is_a(value: Any, kind: type) -> bool:
    """Whether `value` is a number of `kind` (numbers.Real, numbers.Integral); a bool is none."""
    return isinstance(value, kind) and not isinstance(value, bool)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not _is_a(temperature, numbers.Real):
        raise InputError(f"temperature must be a number, got {temperature!r}")
    if top_k is not None and not _is_a(top_k, numbers.Integral):
        raise InputError(f"top_k must be a whole number, got {top_k!r}")
    if top_p is not None and not _is_a(top_p, numbers.Real):
        raise InputError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")


def _token_ids(value: Any, name: str, vocab_size: int | None) -> list[int]:
    """eos/pad ids given as one id (int, numpy or 0-d tensor) or several, each in [0, vocab_size)
    (when the session's model says its vocabulary size)."""
    if value is None:
        return []
    items = value.tolist() if hasattr(value, "tolist") else value
    items = [items] if isinstance(items, numbers.Integral) else items
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InputError(f"{name} is a token id or a list of them, got {value!r}")
    for item in items:
        if not _is_a(item, numbers.Integral) or item < 0 or (vocab_size is not None and item >= vocab_size):
            raise InputError(
                f"{name} holds {item!r}, not a token id of the model's vocabulary [0, {vocab_size or '...'})"
            )
    return [int(item) for item in items]


def generate(
    session: Session,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    on_token: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Prefill input_ids [B, T] into `session` (attention_mask [B, T]: 0 for left padding, see
    Session.prefill), then sample up to max_new_tokens with `step`.

    Returns [B, T + new] ids. A row ends at its first token among eos_token_id (one id or
    several) and continues with pad_token_id (default: the first eos id); the loop stops early
    once every row has ended. `on_token`, if given, is called with each new token [B] (pad for
    the rows already ended) and may return a bool [B] of rows that end with it, as at an eos
    (transformers' streamers and stopping criteria run on it).
    """
    if not callable(getattr(session, "prefill", None)):  # a model, say, where its session belongs
        raise InputTypeError(
            f"generate decodes in a Session, got a {type(session).__name__}; pass model.new_session(batch_size) "
            "(or call model.generate(input_ids, ...))"
        )
    if not _is_a(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    vocab_size = getattr(getattr(getattr(session, "model", None), "config", None), "vocab_size", None)
    eos_ids = _token_ids(eos_token_id, "eos_token_id", vocab_size)
    pad_ids = _token_ids(pad_token_id, "pad_token_id", vocab_size)
    if len(pad_ids) > 1:
        raise InputError(f"pad_token_id is one token id, got {pad_token_id!r}")
    pad_token_id = pad_ids[0] if pad_ids else eos_ids[0] if eos_ids else None
    if not isinstance(input_ids, torch.Tensor):
        raise InputTypeError(
            f"input_ids must be a tensor of token ids, got a {type(input_ids).__name__}; wrap them with torch.tensor(...)"
        )
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    logits = session.prefill(input_ids, attention_mask)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=logits.device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=logits.device)
    unsampled = torch.tensor(list(session.model.reserved_ids().values()), dtype=torch.long, device=logits.device)
    new_tokens = []
    for i in range(max_new_tokens):
        if unsampled.numel():
            logits = logits.index_fill(-1, unsampled, float("-inf"))
        token = sample_next_token(logits, temperature, top_k, top_p, generator)
        if pad_token_id is not None:  # rows end only with a pad id to continue with
            token = token.masked_fill(finished, pad_token_id)
        if eos_ids:
            finished |= torch.isin(token, eos)
        new_tokens.append(token)
        ended = None if on_token is None else on_token(token)
        if ended is not None:
            if pad_token_id is None:
                raise InputError("rows that end before the others need pad_token_id (or eos_token_id); pass one")
            finished |= torch.as_tensor(ended, dtype=torch.bool, device=finished.device)
        if i + 1 == max_new_tokens or bool(finished.all()):
            break
        logits = session.step(token)
    if not new_tokens:
        return input_ids
    return torch.cat([input_ids.to(logits.device), torch.stack(new_tokens, dim=1)], dim=1)


def continue_text(
    model: torch.nn.Module,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> str:
    """The text `model` writes after `prompt` (farsight.data tokenizer; an empty prompt starts from
    the BOS token), sampled with a generator seeded by `seed`: `farsight generate` with the same
    arguments prints the prompt followed by this text."""
    ids = torch.tensor([tokenizer.encode(prompt) or [tokenizer.bos_id]], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=tokenizer.eos_id,
        generator=generator,
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())
