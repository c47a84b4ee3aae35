"""What every farsight causal LM shares: output type, loss, input checks, the session and
generate entry points, and save/load of its model directory."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from farsight.config import ConfigBase, ConfigError
from farsight.data.tokenizers import TOKENIZER_FILENAME
from farsight.errors import InputError, InputTypeError, ModelFileError
from farsight.layers.attention import check_no_cache
from farsight.models.io import (
    CONFIG_FILE,
    HF_SHIM_FILE,
    WEIGHTS_FILE,
    load_weights,
    read_model_meta,
    resolve_model_dir,
    verify_model_dir,
    write_checksums,
    write_model_dir,
)
from farsight.models.session import Session
from farsight.ops.documents import check_document_ids, document_starts

MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # what a model can run in


@dataclass
class CausalLMOutput:
    """loss: mean next-token cross-entropy (None without labels); logits [B, T, V] for real tokens."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None  # None when the forward was asked for the loss alone (return_logits=False)
    retrieval: Any = None
    # with return_hidden: the final norm's output [B, T, D] (what the LM head reads), and no logits or loss
    hidden: torch.Tensor | None = None
    # with retrieval targets (a causal-retrieval model): the supervised retrieval's loss and the
    # share of supervised retrievals that found the evidence (CausalRetrievalLM.supervised_retrieval)
    retrieval_loss: torch.Tensor | None = None
    retrieval_found: torch.Tensor | None = None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Position t predicts labels[t + 1]; labels of -100 are ignored.

    weights [B, T] (optional) scale each target token's loss (weights[t + 1] for the prediction made
    at t); the loss is the weighted mean, so answer tokens can count more than context tokens.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, fp64 for fp64 logits
    targets, valid = _loss_targets(labels, weights, logits.shape, dtype)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).to(dtype), targets, ignore_index=-100, reduction="none")
    return (ce * valid).sum() / valid.sum().clamp(min=1e-8)


# From this vocabulary size on a loss-only forward (return_logits=False, what the trainer asks
# for) takes the chunked cross-entropy: a GPT-2-sized head (50257 ids) over 16K tokens would
# otherwise hold [tokens, vocab] logits in fp32 (3.3 GB) and their gradient. Below it the
# plain loss is faster (one GEMM, one fused log-softmax).
CHUNKED_LOSS_MIN_VOCAB = 8192
# Rows (tokens) per chunk: [rows, vocab] logits in fp32 are about 400 MB at 50257 ids.
CHUNKED_LOSS_ROWS = 2048


def _loss_targets(
    labels: torch.Tensor, weights: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [N], per-row loss weights [N] in `dtype`: 0 for ignored labels) of the predictions
    at positions 0..T-2 for logits of `shape` [B, T, ...]."""
    if labels.shape != shape[:2]:
        raise InputError(f"labels must have shape {list(shape[:2])} (batch, tokens), got {list(labels.shape)}")
    targets = labels[:, 1:].flatten()
    valid = (targets != -100).to(dtype)
    if weights is not None:
        if weights.shape != labels.shape:
            raise InputError(
                f"loss weights must have the shape of labels {list(labels.shape)}, got {list(weights.shape)}"
            )
        valid = valid * weights[:, 1:].flatten().to(dtype)
    return targets, valid


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i W^T, t_i) over row chunks, never holding more than one chunk's logits.

    The backward recomputes each chunk's logits from the saved hidden rows and the per-row
    logsumexp. Products in the inputs' dtype (autocast's, cast by the caller), softmax and
    statistics in fp32, the head weight's gradient summed over the chunks in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, rows):  # type: ignore[override]
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        safe = targets.clamp(min=0)
        for start in range(0, hidden.shape[0], rows):
            stop = min(start + rows, hidden.shape[0])
            logits = (hidden[start:stop] @ weight.t()).float()
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[start:stop, None])[:, 0]
            total += ((lse[start:stop] - picked) * row_weights[start:stop]).sum()
        ctx.save_for_backward(hidden, weight, safe, row_weights, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, safe, row_weights, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.rows):
            stop = min(start + ctx.rows, hidden.shape[0])
            logits = (hidden[start:stop] @ weight.t()).to(lse.dtype)
            grad = logits.sub_(lse[start:stop, None]).exp_()
            grad.scatter_add_(1, safe[start:stop, None], grad.new_full((stop - start, 1), -1.0))
            grad = grad.mul_((row_weights[start:stop] * grad_total)[:, None]).to(hidden.dtype)
            grad_hidden[start:stop] = grad @ weight
            grad_weight += grad.t() @ hidden[start:stop]
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    rows: int = CHUNKED_LOSS_ROWS,
) -> torch.Tensor:
    """`causal_lm_loss(hidden @ weight.T, labels, weights)` without the [B, T, V] logits.

    hidden [B, T, D] (the final norm's output), weight [V, D] (the LM head's). Under autocast the
    products run in the autocast dtype, as the head's nn.Linear would; the loss and the softmax
    are fp32, as in `causal_lm_loss`. Equal to the plain loss up to the order of fp32 sums.
    """
    targets, row_weights = _loss_targets(labels, weights, hidden.shape, torch.float32)
    device_type = hidden.device.type
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1]).to(dtype)
        total = _ChunkedCrossEntropy.apply(flat, weight.to(dtype), targets, row_weights, rows)
    return total / row_weights.sum().clamp(min=1e-8)


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, forbidden: dict[str, int] | None = None) -> torch.Tensor:
    """Token ids must be a [B, T] (or [T]) integer tensor inside the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise InputTypeError("input_ids must be an integer torch.Tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must have shape [batch, tokens], got {list(input_ids.shape)}")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); "
                "was the data tokenized with another tokenizer?"
            )
        for name, token in (forbidden or {}).items():
            if bool((input_ids == token).any()):
                raise InputError(
                    f"input_ids contain the {name} token id {token}; it is inserted by the model, pass plain text tokens"
                )
    return input_ids.long()


def check_packed_input(
    input_ids: torch.Tensor, document_ids: object, caches: object = None, attention_mask: object = None
) -> torch.Tensor | None:
    """document_ids for checked input_ids [B, T]: validated ([B, T] integers, never decreasing
    along a row) or None. Packed rows are a cacheless forward without left padding."""
    if document_ids is None:
        return None
    if caches is not None:
        check_no_cache(caches)
    if attention_mask is not None:
        raise InputError(
            "pass document_ids or attention_mask, not both: a packed row has no padding to mask "
            "(give padding its own document id instead)"
        )
    return check_document_ids(document_ids, tuple(input_ids.shape)).to(input_ids.device)


def checked_labels(
    labels: torch.Tensor | None, document_ids: torch.Tensor | None, vocab_size: int
) -> torch.Tensor | None:
    """labels [B, T], integer ids in the vocabulary or -100 (ignored), refused otherwise (an id
    past the vocabulary would fail deep in the loss, on a GPU as a device-side assert); in a
    packed row every document's first token is set to -100: the last token of a packed document
    predicts nothing, as when the document is run on its own."""
    if labels is None:
        return labels
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise InputTypeError(
            "labels must be an integer torch.Tensor of token ids (-100 for positions without a target)"
        )
    outside = (labels >= vocab_size) | ((labels < 0) & (labels != -100))
    if labels.numel() and bool(outside.any()):  # one reduction and one read; the offender only on error
        bad = int(labels[outside][0])
        raise InputError(
            f"label {bad} is outside the model's vocabulary [0, {vocab_size}); labels are token ids, or -100 "
            "where a position has no target"
        )
    if document_ids is None:
        return labels
    if labels.shape != document_ids.shape:
        raise InputError(f"labels must have shape {list(document_ids.shape)} (batch, tokens), got {list(labels.shape)}")
    return labels.masked_fill(document_starts(document_ids), -100)


class PretrainedLM(nn.Module):
    """Base of farsight's LMs: a config, a forward, a Session for decoding, and a model
    directory (config.json with the model type + config, model.safetensors, checksums.json)."""

    model_type: ClassVar[str]
    config_class: ClassVar[type[ConfigBase]]
    config: Any

    def __init__(self, config: Any) -> None:
        super().__init__()
        expected = getattr(type(self), "config_class", None)  # a subclass outside farsight may name none
        if expected is not None and not isinstance(config, expected):
            raise InputTypeError(
                f"{type(self).__name__} is built from a {expected.__name__}, got a {type(config).__name__}; pass "
                f"{expected.__name__}(...), or {expected.__name__}.from_dict(mapping) for a mapping "
                "(farsight.models.build_model takes a training config's model section)"
            )
        self.config = config

    @classmethod
    def config_defaults(cls, tokenizer: Any) -> dict[str, Any]:
        """Config values a tokenizer determines when the config leaves them out."""
        return {"vocab_size": tokenizer.vocab_size}

    @classmethod
    def check_tokenizer(cls, config: Any, tokenizer: Any) -> None:
        """Raise ConfigError if `config` cannot be trained with `tokenizer`'s special tokens."""

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- activation checkpointing ----------------------------------------------------------------
    # Off by default; a class attribute so that models built before it existed read False too.
    activation_checkpointing: bool = False
    _checkpoint_fn: Callable[..., Any] | None = None

    def set_activation_checkpointing(
        self, enabled: bool = True, checkpoint_fn: Callable[..., Any] | None = None
    ) -> PretrainedLM:
        """Recompute each block's activations in the backward instead of keeping them
        (torch.utils.checkpoint, non-reentrant, per block: the lower, chunk-encoder and upper
        blocks of a DRT, every block of a transformer). Only a training forward with gradients
        and without decoding caches is checkpointed; its losses and gradients are those of the
        plain forward (the RNG state is restored for the recomputation; DRT's retrieval and
        memory appends run outside the blocks, once). `checkpoint_fn(block, *args, **kwargs)`
        replaces torch's checkpoint call (transformers passes its own, with the user's options)."""
        self.activation_checkpointing = bool(enabled)
        self._checkpoint_fn = checkpoint_fn if enabled else None
        return self

    def run_block(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """block(*args, **kwargs), checkpointed when activation checkpointing is on and the
        forward trains with gradients. Callers run blocks that take a decoding cache directly:
        a cache appended to in the forward would be appended to again in the recomputation."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            run = self._checkpoint_fn or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            return run(block, *args, **kwargs)
        return block(*args, **kwargs)

    def logits_and_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        loss_weights: torch.Tensor | None,
        return_logits: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The final norm, the LM head and the loss over final hidden states [B, T, D]: (logits
        [B, T, V] or None, loss or None). A loss-only call (return_logits=False, with labels) of a
        model with at least CHUNKED_LOSS_MIN_VOCAB ids takes `chunked_causal_lm_loss`.
        `farsight.train.compile` compiles this method for training."""
        normed = self.norm(hidden)
        if not return_logits and labels is not None and self.config.vocab_size >= CHUNKED_LOSS_MIN_VOCAB:
            return None, chunked_causal_lm_loss(normed, self.lm_head.weight, labels, loss_weights)
        logits = self.lm_head(normed)
        loss = None if labels is None else causal_lm_loss(logits, labels, loss_weights)
        return (logits if return_logits or labels is None else None), loss

    def empty_output(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        loss_weights: torch.Tensor | None,
        return_logits: bool = True,
    ) -> CausalLMOutput | None:
        """The output of a batch without tokens (checked ids of shape [B, 0] or [0, T]), which no
        block runs on: logits [B, T, V] and, with labels, the loss of no prediction (0, as when
        every label is ignored, still part of the autograd graph); None for a batch with tokens."""
        if input_ids.numel():
            return None
        logits, loss = self.logits_and_loss(self.embed(input_ids), labels, loss_weights, return_logits)
        return CausalLMOutput(loss=loss, logits=logits)

    def check_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] or [T] token ids -> [B, T] long; refuses ids the model does not take."""
        return check_input_ids(input_ids, self.config.vocab_size, self.reserved_ids())

    def reserved_ids(self) -> dict[str, int]:
        """Ids of the vocabulary the model inserts itself (name -> id; a DRT's landmark): refused
        as input, and never sampled by generation, whose next step would refuse them."""
        return {}

    def new_session(self, batch_size: int = 1, **options: Any) -> Session:
        """A decoding session over this model (farsight.models.session.Session)."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        **session_options: Any,
    ) -> torch.Tensor:
        """Sample continuations of input_ids [B, T] through a fresh session (session_options go
        to `new_session`, e.g. DRT's memory tier); temperature=0 decodes greedily;
        attention_mask [B, T] marks left padding with 0 (models that mask it). Returns [B, T + new]."""
        input_ids = self.check_input_ids(input_ids)
        with self.new_session(input_ids.shape[0], **session_options) as session:
            return session.generate(
                input_ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos_token_id,
                generator=generator,
                attention_mask=attention_mask,
            )

    def save_pretrained(
        self, path: str | os.PathLike, tokenizer: Any = None, state_dict: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Write config.json, model.safetensors (and tokenizer.json), the HF_SHIM_FILE that
        transformers' `trust_remote_code=True` imports, then checksums.json with their SHA-256.
        `state_dict` overrides the module's own tensors (e.g. the full state
        gathered from FSDP shards). A folder that holds what another farsight command wrote (a
        dataset, a tokenizer, a run or checkpoint, exported tasks) is refused: the model's files
        would replace its own (`farsight.files.folder_kind`)."""
        import farsight
        from farsight.files import FOLDER_KINDS, folder_kind

        path = Path(path)
        held = folder_kind(path)
        if held not in (None, "model", "other"):  # "other": e.g. an output folder of transformers' Trainer
            raise InputError(
                f"{path} holds {FOLDER_KINDS[held]}, whose files the model's would replace; save the model to a new folder"
            )
        meta = {
            "model_type": self.model_type,
            "farsight_version": farsight.__version__,
            "config": self.config.to_dict(),
        }
        tensors = dict(state_dict if state_dict is not None else self.state_dict())
        # tied parameters (e.g. embedding and LM head) are stored once, under their first name
        seen: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                tensors.pop(name, None)
            else:
                seen[id(param)] = name
        write_model_dir(path, meta, tensors)
        if tokenizer is not None:
            tokenizer.save(path)
        write_checksums(path, (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILENAME, HF_SHIM_FILE))
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, map_location: str | torch.device = "cpu") -> PretrainedLM:
        """Load a directory holding a model of this class (any class: farsight.models.load_model),
        refusing files that differ from its checksums.json and weights that are not finite."""
        path = resolve_model_dir(path)
        meta = read_model_meta(path)
        if meta["model_type"] != cls.model_type:
            raise ModelFileError(
                f"{path} holds a {meta['model_type']!r} model, not a {cls.model_type!r} one; "
                "load it with farsight.models.load_model"
            )
        verify_model_dir(path)
        try:
            config = cls.config_class.from_dict(meta["config"], where="config")
        except ConfigError as exc:  # an edited config.json, or one of a newer farsight
            raise ModelFileError(f"{path / CONFIG_FILE}: {exc}") from exc
        model = cls(config)
        load_weights(model, path, map_location)
        return model.to(map_location)
