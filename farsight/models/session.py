"""The inference Session protocol that every farsight LM answers (`model.new_session(...)`).

A session owns a model's decoding state (KV caches, UQ-KV caches, DRT's streaming state and
chunk memory) and is fed tokens in order:

    prefill(ids [B, T] or an iterable of blocks, attention_mask=None, length=None)
                                                 -> next-token logits [B, V]
    step(token [B] or [B, 1])                    -> next-token logits [B, V]
    feed(ids [B, T])                             -> logits [B, T, V] after each token
    score(ids [B, T])                            -> log-probs [B, T] of ids as the continuation
    score_continuation(ids [B, T])               -> log-probs and greedy flags [B, T]
    score_each([ids_1, ids_2, ...])              -> each alternative scored from the same point
    generate(ids, max_new_tokens, ...)           -> [B, T + new] (farsight.models.generation)
    close() / `with`                             -> frees files and buffers, restores train mode

A model implements `_run(ids, every_position)`; batch size, id checks, closing and the
inference-mode switch live here once. The first prefill of a session is the prompt: a model may
lay it out first (`_begin`; DRT left-pads it so that it ends on a chunk boundary, docs/design.md §2.1), and
a left-padded batch (HF's attention_mask: zeros, then ones) is accepted by models that mask
padding (DRT).

A call that fails midway (a full disk, out of memory, an interrupt) must not leave half-advanced
state behind: a session that implements `_mark`/`_undo` is put back as it was before the call
(the call can be retried; of an iterable prefill, the blocks before the failing one stay fed),
any other refuses every later call with a StateError.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from farsight.errors import InputError, InputTypeError, StateError
from farsight.models.generation import generate


@dataclass
class ContinuationScore:
    """A continuation's log-probabilities [B, T] (fp32, or fp64 for an fp64 model) and, per
    token, whether greedy decoding picks it [B, T]."""

    logprobs: torch.Tensor
    greedy: torch.Tensor


def check_left_padding(attention_mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """attention_mask like ids ([B, T] or [T]) of 0/1 (HF convention) with only leading zeros ->
    bool [B, T], True for tokens; anything else is refused with the fix."""
    if not isinstance(attention_mask, torch.Tensor):
        raise InputError("attention_mask must be a torch.Tensor of 0 (padding) and 1 (token)")
    mask = attention_mask if attention_mask.dim() == 2 else attention_mask[None]
    shape = list(ids.shape) if ids.dim() == 2 else [1, ids.shape[-1]]
    if list(mask.shape) != shape:
        raise InputError(
            f"attention_mask has shape {list(attention_mask.shape)} but the ids {list(ids.shape)}; give one 0/1 per token"
        )
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise InputError("attention_mask must hold 0 (padding) and 1 (token) only")
        mask = mask != 0
    if mask.shape[1] and (not bool(mask[:, -1].all()) or bool((mask[:, 1:].int() < mask[:, :-1].int()).any())):
        raise InputError(
            "attention_mask must be left padding (zeros, then ones, every row ending on a token); "
            "pad on the left (tokenizer.padding_side = 'left')"
        )
    return mask


class Session:
    """Base of the per-model sessions; see the module docstring for the protocol.

    prompt_offset: tokens the session put in front of the prompt (DRT's alignment padding), so
    that token i of the prompt sits at stream position prompt_offset + i.
    """

    prompt_offset: int = 0

    def __init__(self, model: nn.Module, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.model = model
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self.tokens_seen = 0
        self._next_logits: torch.Tensor | None = None  # [B, V] after the last token fed
        self._closed = False
        self._failed: str | None = None  # why a failed call left the state unusable
        # sessions decode: no dropout, no Gumbel noise; the caller's mode comes back on close
        self._was_training = model.training
        model.eval()

    # ---- what a model implements ---------------------------------------------------------------
    def _run(self, ids: torch.Tensor, every_position: bool) -> torch.Tensor:
        """ids [B, T] (T >= 1, checked) continuing the state -> logits [B, T, V], or [B, 1, V]
        for the last token only when every_position is False."""
        raise NotImplementedError

    def _mark(self) -> Any:
        """What `_undo` needs to put the state back as it is now; None if the model cannot undo."""
        return None

    def _undo(self, mark: Any) -> None:
        """Put the state back as it was when `mark` was taken."""

    def _begin(self, length: int | None, attention_mask: torch.Tensor | None) -> None:
        """Lay out a prompt of `length` tokens (None: unknown) before it is fed; attention_mask
        [B, T] bool (True = token, left padding False) or None. Models that mask no padding
        refuse padded rows."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise InputError(
                f"{type(self).__name__} does not take left-padded prompts (attention_mask with zeros); "
                "feed each row in a session of its own"
            )

    def _release(self) -> None:
        """Free what the session holds beyond Python objects (files, pinned pages)."""

    def check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] or [T] -> [B, T] long on the model's device; refuses ids outside the vocabulary."""
        return self.model.check_input_ids(ids).to(self.device)

    def retrieved_chunks(self) -> list[set[int]] | None:
        """Per batch row, the past chunks the current position reads (any group); None for
        models without retrieval."""
        return None

    # ---- the protocol --------------------------------------------------------------------------
    def _feed(self, ids: torch.Tensor, every_position: bool) -> torch.Tensor:
        if self._closed:
            raise StateError("this session is closed; start a new one with model.new_session()")
        if self._failed is not None:
            raise StateError(
                f"this session is unusable: an earlier call failed midway ({self._failed}) and left its state "
                "half-advanced; start a new one with model.new_session()"
            )
        ids = self.check_ids(ids)
        if ids.shape[0] != self.batch_size:
            raise InputError(f"the session was opened for batch_size={self.batch_size}, got {ids.shape[0]} rows")
        if ids.shape[1] == 0:
            raise InputError("got no tokens to feed; pass at least one token per row")
        with torch.inference_mode():
            mark = self._mark()
            try:
                logits = self._run(ids, every_position)
            except BaseException as exc:
                self._failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
                if mark is not None:
                    self._undo(mark)
                    self._failed = None
                raise
        self.tokens_seen += ids.shape[1]
        self._next_logits = logits[:, -1]
        return logits

    def prefill(
        self,
        ids: torch.Tensor | Iterable[torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        length: int | None = None,
    ) -> torch.Tensor:
        """Feed a prompt (a [B, T] / [T] tensor, or an iterable of such blocks, e.g. a 16M-token
        file read in pieces); returns the next-token logits [B, V] after its last token.

        On a fresh session the model may align the prompt (DRT: left padding to a chunk
        boundary, masked out; a question at any offset is answered like an aligned one). For an
        iterable, pass the prompt's total `length` in tokens, or it is fed unaligned.
        attention_mask [B, T] (a tensor prompt only): 1 for tokens, 0 for left padding, so rows
        of different lengths share a batch (models that mask padding: DRT).
        """
        if isinstance(ids, torch.Tensor):
            if length is not None and length != ids.shape[-1]:
                raise InputError(
                    f"length={length!r} goes with an iterable of blocks; a tensor prompt's length is its last dimension "
                    f"({ids.shape[-1]}): drop length"
                )
            blocks, length = [ids], ids.shape[-1] or None
            mask = None if attention_mask is None else check_left_padding(attention_mask, ids).to(self.device)
            if mask is not None and self.tokens_seen and not bool(mask.all()):
                raise InputError(
                    "attention_mask with zeros (left padding) goes with a session's first prefill; a later prompt "
                    "continues every row where it stopped, so it has no padding: feed the rows in sessions of their own"
                )
        elif not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
            raise InputTypeError(
                f"prefill takes token ids as a [B, T] / [T] tensor or an iterable of such tensors, got a {type(ids).__name__}; "
                "wrap the ids with torch.tensor(...)"
            )
        else:
            if attention_mask is not None:
                raise InputError(
                    "attention_mask goes with a tensor prompt; for an iterable of blocks, drop the padding instead"
                )
            if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
                raise InputError(f"length must be the prompt's number of tokens (an integer >= 1), got {length!r}")
            blocks, mask = ids, None
        if self.tokens_seen == 0:
            self._begin(length, mask)
        fed = 0
        for block in blocks:
            if not isinstance(block, torch.Tensor):
                raise InputTypeError(
                    f"prefill's blocks are tensors of token ids, got a {type(block).__name__}; "
                    "wrap the ids with torch.tensor(...)"
                )
            if block.shape[-1]:
                self._feed(block, every_position=False)
                fed += block.shape[-1]
        if not fed:
            raise InputError("prefill got no tokens; pass at least one token per row")
        if length is not None and fed != length:
            raise InputError(
                f"prefill was told length={length} but the blocks held {fed} tokens; pass the prompt's true length"
            )
        return self._next_logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] or [B, 1]); returns the next-token logits [B, V]."""
        if not isinstance(token, torch.Tensor):
            raise InputTypeError(
                f"step takes a tensor of one token id per row, got a {type(token).__name__}; wrap it with torch.tensor(...)"
            )
        if token.numel() != self.batch_size:
            raise InputError(f"step takes one token per row ({self.batch_size}), got shape {list(token.shape)}")
        return self._feed(token.reshape(self.batch_size, 1), every_position=False)[:, -1]

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, T]; returns the logits [B, T, V] predicted after each of them."""
        return self._feed(ids, every_position=True)

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [B, T] (fp32, or fp64 for an fp64 model) of ids [B, T] as the
        continuation of what was fed before (at least one token), and feeds them."""
        return self.score_continuation(ids).logprobs

    def score_continuation(self, ids: torch.Tensor) -> ContinuationScore:
        """`score`, with whether greedy decoding picks each token."""
        if self._next_logits is None:
            raise InputError("score needs a context to continue: prefill at least one token first")
        before = self._next_logits
        logits = self.feed(ids)
        ids = self.check_ids(ids)
        predicted = torch.cat([before[:, None], logits[:, :-1]], dim=1)  # [B, T, V]: what each id is drawn from
        predicted = predicted.to(torch.promote_types(predicted.dtype, torch.float32)).log_softmax(-1)
        logprobs = predicted.gather(-1, ids[..., None]).squeeze(-1)
        return ContinuationScore(logprobs, predicted.argmax(-1) == ids)

    def score_each(self, continuations: Sequence[torch.Tensor]) -> list[ContinuationScore]:
        """Score several alternative continuations [B, t_i] of what was fed, each from the same
        point: the session is rewound after each, so a long context is fed once for all of them
        (a multiple-choice question). Sessions that cannot rewind (only DRT's can) refuse."""
        scores = []
        for ids in continuations:
            mark = self._mark()
            if mark is None:
                raise StateError(
                    f"{type(self).__name__} cannot rewind; score each continuation in a session of its own"
                )
            saved = (self.tokens_seen, self._next_logits)
            try:
                scores.append(self.score_continuation(ids))
            finally:
                with torch.inference_mode():
                    self._undo(mark)
                self.tokens_seen, self._next_logits = saved
        return scores

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **sampling: Any) -> torch.Tensor:
        """Prefill input_ids [B, T] and sample up to max_new_tokens (temperature, top_k, top_p,
        eos_token_id, generator: see farsight.models.generation.generate); returns [B, T + new]."""
        return generate(self, input_ids, max_new_tokens, **sampling)

    def close(self) -> None:
        if not self._closed:
            self._release()
            self._closed = True
            self.model.train(self._was_training)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
