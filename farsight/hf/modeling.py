"""farsight models as Hugging Face `PreTrainedModel`s: forward with loss, `generate` on farsight's
streaming Session, and save/load through farsight's own model-directory code.

The wrapper holds the native model as `self.model` and adds nothing to its weights. Loading uses
farsight's loader (checksums verified, safetensors only); saving writes the directory farsight's
`save_pretrained` writes, so `farsight.models.load_model` and `AutoModelForCausalLM` both read it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from farsight.data.tokenizers import TOKENIZER_FILENAME, Tokenizer
from farsight.errors import ConfigError, InputError, ModelFileError
from farsight.hf.configuration import FarsightConfig, FarsightDRTConfig, FarsightTransformerConfig, resolve_dtype
from farsight.models import (
    PretrainedLM,
    build_model,
    causal_lm_loss,
    generate,
    load_model,
    resolve_model_dir,
    set_retrieval_neighbors,
    set_retrieval_top_k,
)
from farsight.models.io import stored_dtype
from farsight.models.lm import checked_labels
from farsight.models.registry import load_model_tokenizer
from farsight.models.session import check_left_padding
from farsight.ops.documents import check_document_ids, document_ids_from_positions, document_starts
from farsight.ops.precision import widened_matmuls

# arguments the Auto classes and the Hub API pass to `from_pretrained`; a local directory needs none
_HUB_KWARGS = (
    "_from_auto",
    "adapter_kwargs",
    "trust_remote_code",
    "revision",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "token",
    "subfolder",
    "code_revision",
    "use_safetensors",
    "low_cpu_mem_usage",
)
# options of transformers' loader (lm-eval's "hf" model passes them as None) that farsight can only
# take unset: quantization, GGUF files, offloading and memory budgets for spreading a model
_OFF_WHEN_NONE = ("max_memory", "gguf_file", "quantization_config", "offload_folder", "tp_plan")
# generation options farsight's sampler does not implement, with the value that means "off"
_UNSUPPORTED_GENERATION = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": None,
    "min_new_tokens": None,
    "min_length": 0,
    "penalty_alpha": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "num_beam_groups": 1,
    "bad_words_ids": None,
    "force_words_ids": None,
    "stop_strings": None,
    "assistant_model": None,
}


# what transformers' generate uses when neither the call nor the generation config sets it
DEFAULT_MAX_NEW_TOKENS = 20
DEFAULT_TOP_K = 50


class FarsightForCausalLM(PreTrainedModel, GenerationMixin):
    """A farsight causal LM (`self.model`) behind the Hugging Face model API.

    `config.memory` / `config.kv_dtype` (set with `from_pretrained(path, memory="disk")`) select
    where a DRT session keeps its chunk memory; `generate(..., memory=...)` overrides them per call.
    """

    config_class: ClassVar[type[FarsightConfig]] = FarsightConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = []
    # transformers' gradient_checkpointing_enable (Trainer's and TRL's gradient_checkpointing=True)
    # reaches the native model's per-block checkpointing through `_set_gradient_checkpointing`
    supports_gradient_checkpointing = True

    def __init__(
        self, config: FarsightConfig, model: PretrainedLM | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        config.dtype = resolve_dtype(config.dtype)
        super().__init__(config)
        # a fresh model is initialised by farsight's constructor; `_init_weights` leaves it as it is
        self.model = model if model is not None else build_model({"type": config.model_type, **config.config})
        if self.model.model_type != config.model_type:
            raise ModelFileError(
                f"the config is a {config.model_type!r} model's but the weights are a {self.model.model_type!r} model's"
            )
        self.farsight_tokenizer = tokenizer
        if tokenizer is not None:
            self.generation_config = GenerationConfig(
                bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
            )
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """farsight's models initialise their weights when built; nothing to add."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = self._same_vocab(value, "set_input_embeddings")

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.lm_head = self._same_vocab(value, "set_output_embeddings")

    def _same_vocab(self, module: torch.nn.Module, method: str) -> torch.nn.Module:
        rows = getattr(module, "weight", None)
        if rows is None or rows.shape[0] != self.config.vocab_size:
            raise InputError(
                f"{method} needs a module with a weight of {self.config.vocab_size} rows (the vocabulary); "
                "change the vocabulary with resize_token_embeddings"
            )
        return module

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> torch.nn.Embedding:
        """Give the model a vocabulary of `new_num_tokens` ids (rounded up to a multiple of
        `pad_to_multiple_of`), as transformers does: the embedding and the LM head keep the rows
        of the ids they had (tied, they stay one tensor); new rows start at the mean of the old
        ones (`mean_resizing`, transformers' default) or at farsight's initialisation. Refuses
        to drop an id the model reserves (a DRT's landmark and pad) or its tokenizer uses.
        Returns the input embedding."""
        embed, head = self.model.embed, self.model.lm_head
        old = embed.num_embeddings
        size = old if new_num_tokens is None else int(new_num_tokens)
        if pad_to_multiple_of is not None:
            size = -(-size // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
        if size == old:
            return embed
        used = [*self.model.reserved_ids().values(), getattr(self.model.config, "pad_id", None)]
        if self.farsight_tokenizer is not None:
            used.append(self.farsight_tokenizer.vocab_size - 1)
        needed = max((i for i in used if i is not None), default=0) + 1
        if size < needed:
            raise InputError(
                f"resize_token_embeddings({size}) would drop ids the model or its tokenizer uses (up to {needed - 1}); "
                f"keep at least {needed} tokens"
            )
        tied = head.weight is embed.weight
        options = {"device": embed.weight.device, "dtype": embed.weight.dtype}
        new_embed = torch.nn.Embedding(size, embed.embedding_dim, **options)
        new_embed.weight.data = self._resized_rows(embed.weight, size, mean_resizing)
        new_head = torch.nn.Linear(head.in_features, size, bias=False, **options)
        if tied:
            new_head.weight = new_embed.weight
        else:
            new_head.weight.data = self._resized_rows(head.weight, size, mean_resizing)
        new_embed.weight.requires_grad_(embed.weight.requires_grad)
        new_head.weight.requires_grad_(head.weight.requires_grad)
        self.model.embed, self.model.lm_head = new_embed, new_head
        self.model.config.vocab_size = size
        self.config.config = {**self.config.config, "vocab_size": size}
        return new_embed

    def _resized_rows(self, weight: torch.Tensor, size: int, mean_resizing: bool) -> torch.Tensor:
        """weight [V, D] cut or grown to [size, D]: new rows at the mean row, or drawn as farsight
        initialises (normal, init_std)."""
        with torch.no_grad():
            rows = weight.detach()[:size].clone()
            if size <= weight.shape[0]:
                return rows
            extra = size - weight.shape[0]
            if mean_resizing:
                grown = weight.detach().float().mean(dim=0, keepdim=True).expand(extra, -1)
            else:
                std = getattr(self.model.config, "init_std", 0.02)
                grown = torch.randn(extra, weight.shape[1], device=weight.device) * std
            return torch.cat([rows, grown.to(weight.dtype)])

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The forward inputs of a generation step: forward keeps no cache, so the whole sequence
        so far (a cache is refused; farsight's own `generate` decodes through a Session)."""
        if kwargs.get("past_key_values") is not None:
            raise InputError("past_key_values is not supported: farsight keeps its caches in a Session; use generate()")
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    # ---- activation checkpointing --------------------------------------------------------------
    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Any = None, every_n_layers: int = 1
    ) -> None:
        """transformers' hook behind `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`
        and `_disable`: the native model checkpoints each of its blocks with
        `gradient_checkpointing_func` (torch's checkpoint with the user's kwargs)."""
        if enable:
            options = getattr(gradient_checkpointing_func, "keywords", None) or {}
            if options.get("use_reentrant", False):
                raise InputError(
                    "farsight checkpoints its blocks non-reentrantly (DRT's retrieved chunks reach a block inside a "
                    "dataclass, which reentrant checkpointing does not backpropagate into): drop use_reentrant=True "
                    "from gradient_checkpointing_kwargs"
                )
            if every_n_layers != 1:
                raise InputError(
                    f"every_n_layers={every_n_layers}: farsight checkpoints every block; leave every_n_layers at 1"
                )
        self.model.set_activation_checkpointing(enable, gradient_checkpointing_func if enable else None)

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.activation_checkpointing

    @property
    def base_model(self) -> FarsightBackbone:
        """The model's body as transformers and TRL call it (`FarsightBackbone`): the final hidden
        states, from which TRL's SFTTrainer computes its loss with the LM head's weight."""
        return FarsightBackbone(self)

    # ---- loading and saving --------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> FarsightForCausalLM:
        """Load a farsight model directory (or a training run's newest checkpoint) with farsight's
        loader. Options: `memory`, `kv_dtype` (DRT sessions), `retrieval_top_k` (the past chunks a
        DRT reads per chunk instead of its own top_k), `retrieval_neighbors` (the chunks it reads
        beside each: N, or "BEFORE:AFTER"), `dtype`/`torch_dtype` ("fp32",
        "bf16", torch.bfloat16, ...; "auto": the dtype config.json records, else the stored
        weights'; unset: fp32), `device_map` (one device, e.g. "cuda")."""
        if args:
            raise InputError("from_pretrained takes the model directory and keyword options only; pass options by name")
        for name in _HUB_KWARGS:
            kwargs.pop(name, None)
        retrieval_top_k = kwargs.pop("retrieval_top_k", None)
        retrieval_neighbors = kwargs.pop("retrieval_neighbors", None)
        config = kwargs.pop("config", None)
        requested = kwargs.pop("dtype", None)
        torch_dtype = kwargs.pop("torch_dtype", None)
        requested = torch_dtype if requested is None else requested
        dtype = None if requested == "auto" else resolve_dtype(requested)
        device = one_device(kwargs.pop("device_map", None))
        for name in _OFF_WHEN_NONE:
            if kwargs.get(name, None) is not None:
                raise InputError(
                    f"from_pretrained does not support {name}={kwargs[name]!r}: farsight loads its own safetensors "
                    "weights whole onto one device; leave it unset"
                )
            kwargs.pop(name, None)
        path = resolve_model_dir(pretrained_model_name_or_path)
        if config is None:
            config_class = cls.config_class if cls.config_class is not FarsightConfig else None
            config = _load_config(path, config_class, kwargs)
        elif kwargs:
            for name in ("memory", "kv_dtype"):
                if name in kwargs:
                    setattr(config, name, kwargs.pop(name))
        if kwargs:
            raise InputError(f"from_pretrained got options farsight does not take: {sorted(kwargs)}; remove them")
        config.session_options()  # refuse a bad memory tier / kv dtype now rather than at generate
        if requested == "auto":
            dtype = _auto_dtype(config, path)
        model = load_model(path)
        if retrieval_top_k is not None:
            set_retrieval_top_k(model, retrieval_top_k)
            config.config = {**config.config, "top_k": model.config.top_k}
        if retrieval_neighbors is not None:
            set_retrieval_neighbors(model, retrieval_neighbors)
            before, after = model.config.neighbors_before, model.config.neighbors_after
            config.config = {**config.config, "neighbors_before": before, "neighbors_after": after}
        if dtype is not None and dtype != next(model.parameters()).dtype:
            model.to(dtype)
        config.dtype = next(model.parameters()).dtype
        tokenizer = (
            load_model_tokenizer(path, model.config.vocab_size) if (path / TOKENIZER_FILENAME).is_file() else None
        )
        wrapper = _class_for(config)(config, model, tokenizer)
        wrapper.name_or_path = str(path)
        if device is not None:
            wrapper.to(device)
        return wrapper.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any) -> None:
        """Write the directory farsight's `save_pretrained` writes (config.json, model.safetensors,
        the tokenizer's spec, checksums.json). `state_dict` (HF names, e.g. from a Trainer) replaces
        the module's tensors; serialisation options of HF's writer do not apply and are ignored."""
        if kwargs.pop("push_to_hub", False):
            raise InputError("farsight does not push to the Hub; save locally and upload the directory yourself")
        state_dict = kwargs.pop("state_dict", None)
        for name in ("safe_serialization", "max_shard_size", "save_function", "variant", "token"):
            kwargs.pop(name, None)
        if kwargs:
            raise InputError(f"save_pretrained got options farsight does not take: {sorted(kwargs)}; remove them")
        if not is_main_process:
            return
        if state_dict is not None:
            prefix = f"{self.base_model_prefix}."
            state_dict = {name.removeprefix(prefix): tensor for name, tensor in state_dict.items()}
        self.model.save_pretrained(Path(save_directory), tokenizer=self.farsight_tokenizer, state_dict=state_dict)

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache_position: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple[torch.Tensor, ...]:
        """input_ids [B, T] -> logits [B, T, V] (the native forward's), and the next-token loss
        when `labels` [B, T] is given (position t predicts labels[t + 1]; -100 is ignored): the
        mean over the targets, or their sum over `num_items_in_batch` (what Trainer passes for
        gradient accumulation).

        attention_mask [B, T] marks each row's tokens with ones as one run, padded on the left or
        on the right. Right-padded rows run as one batch (a causal row's later pads cannot change
        its earlier positions); a batch with left padding runs each row's tokens alone. Pad
        positions get zero logits and are no loss target, nor is a row's first token.

        forward keeps no cache: `use_cache` is accepted and `past_key_values` is always None
        (use generate() or model.model.new_session() to continue a sequence); `cache_position` is
        taken when it counts 0..T-1. `position_ids` count each row's tokens from 0 (what they are
        when left unset) or restart at 0 where a new sequence begins inside a row: the
        padding-free convention of `DataCollatorWithFlattening` and TRL's `padding_free=True`,
        under which each sequence attends only to itself and its first token is no target, as if
        it had a row of its own (farsight's `document_ids`). `logits_to_keep` (an int: the last n positions, 0 for all; or a tensor of
        positions) trims the logits returned; the loss reads them all. `return_dict=False` gives
        the tuple (loss, logits) (loss only with labels). Anything else is refused.
        """
        packing = {name: kwargs.pop(name) for name in PACKED_SEQUENCE_KWARGS if name in kwargs}
        if kwargs:
            raise InputError(f"forward got arguments farsight does not take: {sorted(kwargs)}; remove them")
        if inputs_embeds is not None:
            raise InputError(
                "inputs_embeds is not supported: a farsight model embeds its input_ids itself; pass input_ids"
            )
        if past_key_values is not None:
            raise InputError(
                "past_key_values is not supported: farsight keeps its caches in a Session; use generate() or model.model.new_session()"
            )
        for name, value in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states)):
            if value:
                raise InputError(
                    f"{name}=True is not supported: a farsight model's forward returns logits and loss only; leave {name} unset"
                )
        if input_ids is None:
            raise InputError("forward needs input_ids [batch, tokens]")
        input_ids, tokens, logits, document_ids = self._run(
            input_ids, attention_mask, position_ids, cache_position, packing=packing
        )
        loss = None
        if labels is not None:
            labels = checked_labels(labels.to(logits.device), document_ids, self.config.vocab_size)
            if tokens is not None:  # a target counts when it and the position predicting it are tokens
                targets = tokens.clone()
                targets[:, 1:] &= tokens[:, :-1]
                labels = labels.masked_fill(~targets, -100)
            loss = causal_lm_loss(logits, labels)
            if num_items_in_batch is not None:
                loss = loss * (labels[:, 1:] != -100).sum() / torch.as_tensor(num_items_in_batch, device=loss.device)
        if isinstance(logits_to_keep, int):
            logits = logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
        else:
            logits = logits[:, logits_to_keep.to(logits.device)]
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return out.to_tuple() if return_dict is False else out

    def _run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        hidden: bool = False,
        packing: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """What forward and the body share: input_ids checked, `tokens` [B, T] marking each row's
        tokens (None: all; `token_runs`), the positions checked against them, then the logits
        [B, T, V] (or, with `hidden`, the final norm's output [B, T, D]) of `_padded_logits`, and
        the document ids [B, T] of packed rows (None when no position restarts). `packing`: the
        sequence boundaries a padding-free collator adds (PACKED_SEQUENCE_KWARGS), which must
        agree with the positions."""
        input_ids = self.model.check_input_ids(input_ids)
        tokens = None
        if attention_mask is not None:
            attention_mask = check_mask_shape(attention_mask, input_ids)  # even all ones: another shape is a mistake
            if not bool(attention_mask.all()):
                tokens = token_runs(attention_mask.to(input_ids.device), input_ids)
        document_ids = _check_positions(position_ids, cache_position, tokens, input_ids)
        document_ids = _check_sequence_boundaries(packing or {}, document_ids, input_ids)
        # bf16/fp16 products the CPU lacks run as fp32 GEMMs here (a backward outside runs torch's)
        with widened_matmuls(self.device, self.dtype):
            return input_ids, tokens, self._padded_logits(input_ids, tokens, hidden, document_ids), document_ids

    def _padded_logits(
        self,
        input_ids: torch.Tensor,
        tokens: torch.Tensor | None,
        hidden: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of input_ids with `tokens` [B, T] (None: all) marking each row's tokens
        and `document_ids` [B, T] its packed sequences (None: one); with `hidden`, the final norm's
        output [B, T, D] instead (`FarsightBackbone`)."""

        def run(ids: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
            out = self.model(ids, return_hidden=hidden, document_ids=documents)
            return out.hidden if hidden else out.logits

        if tokens is None:
            return run(input_ids, document_ids)
        if bool((tokens[:, 0] | ~tokens.any(dim=1)).all()):
            # right padding only: a causal row's later pads cannot change its earlier positions
            return run(input_ids).masked_fill(~tokens[..., None], 0)
        starts, lengths = tokens.int().argmax(dim=1).tolist(), tokens.sum(dim=1).tolist()
        rows = {
            row: run(input_ids[row : row + 1, start : start + length])[0]
            for row, (start, length) in enumerate(zip(starts, lengths))
            if length
        }
        first = next(iter(rows.values()))  # a row starting after 0 holds a token
        logits = first.new_zeros(*input_ids.shape, first.shape[-1])  # [B, T, V]
        for row, row_logits in rows.items():
            logits[row, starts[row] : starts[row] + lengths[row]] = row_logits
        return logits

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        attention_mask: torch.Tensor | None = None,
        memory: str | None = None,
        kv_dtype: str | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Continue input_ids [B, T] through farsight's Session; returns [B, T + new] like HF.

        Reads `generation_config` (default: the model's) updated by kwargs: max_new_tokens (or
        max_length; neither: 20 new tokens, as transformers), do_sample, temperature, top_k
        (unset: 50, as transformers), top_p, eos_token_id (an id or a list), pad_token_id. A
        left-padding attention_mask (farsight's tokenizer pads on the left; right padding is
        refused) is masked by a DRT session (one session for the batch); other models run each
        row's real tokens in a session of its own, the rows stepped together. The output keeps the prompt's pads, and rows that ended early are
        padded with pad_token_id after their eos. As in transformers, `streamer` is given the
        prompt [B, T], then each new token [B], then `end()`; `stopping_criteria` is called
        with the ids so far after each token and ends the rows it returns True for.
        memory/kv_dtype override the model's DRT session options for this call; `generator`
        seeds sampling.
        """
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if input_ids is None:
            raise InputError("generate needs input_ids [batch, tokens]; pass them as the first argument")
        input_ids = self.model.check_input_ids(input_ids).to(self.device)
        streamer = kwargs.pop("streamer", None)
        stopping_criteria = kwargs.pop("stopping_criteria", None)
        options = self._generation_options(generation_config, kwargs, input_ids.shape[1])
        session_options = self.config.session_options(memory, kv_dtype)
        sampling = {key: options[key] for key in ("temperature", "top_k", "top_p")}
        mask = None
        if attention_mask is not None:  # checked even when all ones: a mask of another shape is a mistake
            mask = check_left_padding(attention_mask, input_ids)
            mask = None if bool(mask.all()) else mask
        ids_so_far = [input_ids]

        def on_token(token: torch.Tensor) -> torch.Tensor | None:  # token [B] -> rows that end with it
            if streamer is not None:
                streamer.put(token.cpu())
            if not stopping_criteria:
                return None
            ids_so_far.append(token[:, None])
            return stopping_criteria(torch.cat(ids_so_far, dim=1), None)

        if streamer is not None:
            streamer.put(input_ids.cpu())
        # a DRT session masks left padding itself; other models' sessions take unpadded rows
        rows_apart = mask is not None and self.model.model_type != "drt"
        open_session = functools.partial(RowSessions, self.model) if rows_apart else self.model.new_session
        with (
            widened_matmuls(input_ids.device, self.dtype),
            open_session(input_ids.shape[0], **session_options) as session,
        ):
            out = generate(
                session,
                input_ids,
                options["max_new_tokens"],
                eos_token_id=options["eos_token_ids"],
                pad_token_id=options["pad_token_id"],
                generator=generator,
                attention_mask=mask,
                on_token=on_token if streamer is not None or stopping_criteria else None,
                **sampling,
            )
        if streamer is not None:
            streamer.end()
        return out

    def _generation_options(
        self, generation_config: GenerationConfig | None, kwargs: dict[str, Any], prompt_length: int
    ) -> dict[str, Any]:
        """What farsight's generate needs, from HF's GenerationConfig updated by kwargs."""
        for name in ("logits_processor", "prefix_allowed_tokens_fn"):
            if kwargs.pop(name, None) is not None:
                raise InputError(
                    f"generate does not support {name}; farsight samples with temperature/top_k/top_p only"
                )
        config = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unused = config.update(**kwargs)
        unused.pop("use_cache", None)
        if unused:
            raise InputError(f"generate got options farsight does not take: {sorted(unused)}; remove them")
        for name, off in _UNSUPPORTED_GENERATION.items():
            if getattr(config, name, off) not in (off, None):
                raise InputError(
                    f"generate does not support {name}={getattr(config, name)!r}; farsight's generate samples one sequence per row "
                    f"with temperature, top_k and top_p only: leave {name} at {off!r}"
                )
        if config.max_new_tokens is not None:
            max_new_tokens = config.max_new_tokens
        elif config.max_length is None:  # neither set: transformers' default, 20 new tokens
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        else:
            max_new_tokens = config.max_length - prompt_length
            if max_new_tokens < 1:
                raise InputError(
                    f"max_length={config.max_length} leaves no room after the {prompt_length}-token prompt; pass max_new_tokens"
                )
        eos = config.eos_token_id
        eos_ids = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
        pad = config.pad_token_id if config.pad_token_id is not None else next(iter(sorted(eos_ids)), None)
        if pad is None:
            raise InputError("generate needs pad_token_id (or eos_token_id) to pad finished rows; pass pad_token_id")
        sample = bool(config.do_sample)
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": float(config.temperature if config.temperature is not None else 1.0) if sample else 0.0,
            "top_k": (DEFAULT_TOP_K if config.top_k is None else config.top_k) or None if sample else None,
            "top_p": config.top_p if sample and config.top_p is not None and config.top_p < 1 else None,
            "eos_token_ids": sorted(eos_ids),
            "pad_token_id": int(pad),
        }


class FarsightBackbone:
    """The body of a FarsightForCausalLM (its `base_model`): input_ids [B, T] -> BaseModelOutput
    whose last_hidden_state [B, T, D] is the final norm's output, what the LM head reads. TRL's
    SFTTrainer calls it to score the labelled positions through the head in tiles, never holding
    the [B, T, V] logits. It takes what the wrapper's forward takes (padding on either side,
    position_ids and cache_position as forward checks them, use_cache, return_dict); its
    parameters are the wrapper's `model`."""

    def __init__(self, wrapper: FarsightForCausalLM) -> None:
        self.wrapper = wrapper

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput | tuple[torch.Tensor, ...]:
        packing = {name: kwargs.pop(name) for name in PACKED_SEQUENCE_KWARGS if name in kwargs}
        unused = sorted(name for name, value in kwargs.items() if value is not None and value is not False)
        if unused:
            raise InputError(f"the model's body got arguments farsight does not take: {unused}; remove them")
        if input_ids is None:
            raise InputError("the model's body needs input_ids [batch, tokens]")
        _, _, hidden, _ = self.wrapper._run(
            input_ids, attention_mask, position_ids, cache_position, hidden=True, packing=packing
        )
        out = BaseModelOutput(last_hidden_state=hidden)
        return out.to_tuple() if return_dict is False else out


class FarsightDRTForCausalLM(FarsightForCausalLM):
    """A farsight DRT behind the Hugging Face model API (see FarsightForCausalLM)."""

    config_class = FarsightDRTConfig


class FarsightTransformerForCausalLM(FarsightForCausalLM):
    """A farsight transformer (causal, sliding, castle, castle-swl) behind the Hugging Face model API."""

    config_class = FarsightTransformerConfig


MODEL_CLASSES: dict[str, type[FarsightForCausalLM]] = {
    cls.config_class.model_type: cls for cls in (FarsightDRTForCausalLM, FarsightTransformerForCausalLM)
}


class RowSessions:
    """A left-padded batch for a model whose sessions take no padding: one session per row, fed
    that row's real tokens, the rows prefilled and stepped together (what `farsight.models.generate`
    asks of a session: `prefill`, `step`, `model`, `with`)."""

    def __init__(self, model: PretrainedLM, batch_size: int, **options: Any) -> None:
        self.model = model
        with contextlib.ExitStack() as stack:  # a session that fails to open closes those before it
            self.sessions = [stack.enter_context(model.new_session(1, **options)) for _ in range(batch_size)]
            self._stack = stack.pop_all()

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] with left padding where attention_mask is 0 -> next-token logits [B, V]."""
        width = ids.shape[1]
        lengths = [width] * len(self.sessions) if attention_mask is None else left_padded_lengths(attention_mask, ids)
        return torch.cat(
            [s.prefill(ids[row : row + 1, width - n :]) for row, (s, n) in enumerate(zip(self.sessions, lengths))]
        )

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B] -> next-token logits [B, V]."""
        return torch.cat([s.step(token[row : row + 1]) for row, s in enumerate(self.sessions)])

    def __enter__(self) -> RowSessions:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def _auto_dtype(config: FarsightConfig, path: Path) -> torch.dtype | None:
    """What `dtype="auto"` loads the model of directory `path` in: the dtype its config.json
    records (farsight writes the stored weights'), else the stored weights' own (one farsight
    runs in); None leaves the model in farsight's default, fp32."""
    for dtype in (config.dtype, stored_dtype(path)):
        with contextlib.suppress(ConfigError):
            if (resolved := resolve_dtype(dtype)) is not None:
                return resolved
    return None


def _class_for(config: FarsightConfig) -> type[FarsightForCausalLM]:
    return MODEL_CLASSES[config.model_type]


def _load_config(path: Path, config_class: type[FarsightConfig] | None, kwargs: dict[str, Any]) -> FarsightConfig:
    """The config of directory `path` with the session options in kwargs (taken out of kwargs)."""
    from transformers import AutoConfig

    options = {name: kwargs.pop(name) for name in ("memory", "kv_dtype") if name in kwargs}
    config = AutoConfig.from_pretrained(path, **options)
    if config_class is not None and not isinstance(config, config_class):
        raise ModelFileError(
            f"{path} holds a {config.model_type!r} model; load it with AutoModelForCausalLM.from_pretrained"
        )
    return config


def one_device(device_map: Any) -> torch.device | None:
    """The device a `from_pretrained` device_map puts the whole model on: a device ("cpu",
    "cuda:0", torch.device, or a GPU index as transformers reads an int), or a dict whose values
    all name that one device ({"": "cpu"}, as lm-eval passes). Anything that spreads a model over
    devices ("auto", "balanced", "disk", two devices) is refused; None for None."""
    if device_map is None:
        return None
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    devices = {_device(value) for value in values}
    if len(devices) == 1 and None not in devices:
        return devices.pop()
    raise InputError(
        f"device_map={device_map!r}: a farsight model runs whole on one device; pass device_map='cpu', 'cuda:0' "
        "or {'': 'cuda:0'}"
    )


def _device(value: Any) -> torch.device | None:
    """The device one device_map value names (an int is a GPU index); None if it names none."""
    try:
        device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, TypeError):
        return None
    return None if device.type == "meta" else device


def left_padded_lengths(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> list[int]:
    """The number of real tokens of each row of a left-padding attention_mask [B, T] (zeros, then ones)."""
    return check_left_padding(attention_mask, input_ids).sum(dim=1).tolist()


def check_mask_shape(attention_mask: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """attention_mask as [B, T] (a [T] one gains the batch dimension), refused unless it is a tensor
    of input_ids' shape [B, T]."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if not isinstance(attention_mask, torch.Tensor) or list(attention_mask.shape) != list(input_ids.shape):
        raise InputError(
            f"attention_mask must be a tensor of the ids' shape {list(input_ids.shape)}, one 0/1 per token"
        )
    return attention_mask


def token_runs(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T] of an attention_mask [B, T] of 0 (padding) and 1 (token) whose rows each hold
    their tokens as one run: padding on the left, on the right or both; anything else is refused.
    A mask [T] is the mask of one row."""
    attention_mask = check_mask_shape(attention_mask, input_ids)
    if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise InputError("attention_mask must hold 0 (padding) and 1 (token) only")
    tokens = attention_mask != 0
    runs = tokens[:, :1].int() + (tokens[:, 1:].int() > tokens[:, :-1].int()).sum(dim=1, keepdim=True)
    if bool((runs > 1).any()):
        raise InputError(
            "attention_mask must mark each row's tokens as one run, padded on the left or the right; "
            "for packed rows (several sequences in a row) pass position_ids restarting at 0 at each sequence instead"
        )
    return tokens


# What padding-free collators pass beside position_ids for varlen kernels (transformers'
# DataCollatorWithFlattening with return_flash_attn_kwargs / return_seq_idx, TRL's padding_free).
PACKED_SEQUENCE_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _check_sequence_boundaries(
    packing: dict[str, Any], document_ids: torch.Tensor | None, input_ids: torch.Tensor
) -> torch.Tensor | None:
    """The document ids [B, T] of a batch from position_ids (`document_ids`, None: one sequence
    a row) and a collator's varlen boundaries: cu_seq_lens_q/_k (cumulative lengths [n + 1] of
    the sequences of a one-row batch), seq_idx ([B, T] sequence of each token); max_length_q/_k
    are informational. Every source given must describe the same sequences."""
    b, t = input_ids.shape
    found = {"position_ids": document_ids if document_ids is not None else torch.zeros_like(input_ids)}
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        lengths = packing.get(name)
        if lengths is None:
            continue
        lengths = torch.as_tensor(lengths).reshape(-1).long().cpu()
        sizes = lengths.diff()
        if b != 1 or len(lengths) < 2 or int(lengths[0]) != 0 or int(lengths[-1]) != t or bool((sizes < 0).any()):
            raise InputError(
                f"{name} must be the cumulative lengths 0, ..., {t} of the sequences packed in one row of {t} tokens, "
                f"got {lengths.tolist()[:8]} for a batch of shape {[b, t]}"
            )
        found[name] = torch.repeat_interleave(torch.arange(len(sizes)), sizes)[None].to(input_ids.device)
    if packing.get("seq_idx") is not None:
        found["seq_idx"] = check_document_ids(torch.as_tensor(packing["seq_idx"]), (b, t), "seq_idx").to(
            input_ids.device
        )
    reference = found.pop("position_ids")
    for name, ids in found.items():
        if not torch.equal(document_starts(ids), document_starts(reference)):
            raise InputError(
                f"{name} and position_ids describe different packed sequences; pass position_ids restarting at 0 "
                f"where each sequence begins, and {name} of the same sequences (or leave {name} out)"
            )
    return document_ids


def _check_positions(
    position_ids: torch.Tensor | None,
    cache_position: torch.Tensor | None,
    tokens: torch.Tensor | None,
    input_ids: torch.Tensor,
) -> torch.Tensor | None:
    """Refuse a cache_position other than 0..T-1, and position_ids [B, T] / [T] that neither count
    each row's tokens from 0 nor restart at 0 where a packed sequence begins (each position 0 or
    one more than the one before it). Returns the document ids [B, T] of packed rows, None when
    no position restarts."""
    width = input_ids.shape[1]
    if cache_position is not None and not torch.equal(
        cache_position.cpu(), torch.arange(width, dtype=cache_position.dtype)
    ):
        raise InputError(
            f"cache_position must be 0..{width - 1}: forward keeps no cache of earlier tokens; "
            "continue a sequence with generate() or model.model.new_session()"
        )
    if position_ids is None:
        return None
    tokens = torch.ones_like(input_ids, dtype=torch.bool) if tokens is None else tokens
    expected = tokens.long().cumsum(dim=1) - 1
    fits = position_ids.dim() in (1, 2) and position_ids.shape[-1] == width
    fits = fits and (position_ids.dim() == 1 or position_ids.shape[0] in (1, input_ids.shape[0]))
    if fits:
        positions = position_ids.to(expected.device).expand_as(expected)
        if not bool((positions != expected)[tokens].any()):
            return None
        # the padding-free convention: rows without padding whose positions run 0, 1, ... and restart at 0
        steps = positions[:, 1:] == positions[:, :-1] + 1
        restarting = bool(tokens.all()) and bool((positions[:, 0] == 0).all())
        if restarting and bool((steps | (positions[:, 1:] == 0)).all()):
            return document_ids_from_positions(positions)
    raise InputError(
        "position_ids must count each row's tokens from 0 (what they are when left unset), or restart at 0 where "
        "a packed sequence begins in a row without padding (DataCollatorWithFlattening); leave position_ids unset "
        "otherwise"
    )
