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
from transformers.modeling_outputs import CausalLMOutputWithPast

from farsight.data.tokenizers import TOKENIZER_FILENAME, Tokenizer
from farsight.errors import InputError, ModelFileError
from farsight.hf.configuration import FarsightConfig, FarsightDRTConfig, FarsightTransformerConfig, resolve_dtype
from farsight.models import PretrainedLM, build_model, causal_lm_loss, generate, load_model, resolve_model_dir
from farsight.models.registry import load_model_tokenizer
from farsight.models.session import check_left_padding
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


class FarsightForCausalLM(PreTrainedModel, GenerationMixin):
    """A farsight causal LM (`self.model`) behind the Hugging Face model API.

    `config.memory` / `config.kv_dtype` (set with `from_pretrained(path, memory="disk")`) select
    where a DRT session keeps its chunk memory; `generate(..., memory=...)` overrides them per call.
    """

    config_class: ClassVar[type[FarsightConfig]] = FarsightConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = []

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

    # ---- loading and saving --------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
    ) -> FarsightForCausalLM:
        """Load a farsight model directory (or a training run's newest checkpoint) with farsight's
        loader. Options: `memory`, `kv_dtype` (DRT sessions), `dtype`/`torch_dtype` ("fp32",
        "bf16", torch.bfloat16, ...), `device_map` (one device, e.g. "cuda")."""
        if args:
            raise InputError("from_pretrained takes the model directory and keyword options only; pass options by name")
        for name in _HUB_KWARGS:
            kwargs.pop(name, None)
        config = kwargs.pop("config", None)
        dtype = resolve_dtype(kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None))
        kwargs.pop("torch_dtype", None)
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
        model = load_model(path)
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
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids [B, T] -> logits [B, T, V] (the native forward's), and the mean next-token
        loss when `labels` [B, T] is given (position t predicts labels[t + 1]; -100 is ignored).

        A left-padding attention_mask [B, T] (each row: zeros, then ones) runs each row's real
        tokens through the model alone; the logits of pad positions are zeros.
        """
        for name in ("past_key_values", "inputs_embeds"):
            if kwargs.get(name) is not None:
                raise InputError(
                    f"{name} is not supported: farsight keeps its caches in a Session; use generate() or model.model.new_session()"
                )
        # bf16/fp16 products the CPU lacks run as fp32 GEMMs here (a backward outside runs torch's)
        with widened_matmuls(self.device, self.dtype):
            if attention_mask is None or bool(attention_mask.all()):
                logits = self.model(input_ids).logits
            else:
                width = input_ids.shape[1]
                rows = [
                    self.model(input_ids[row : row + 1, width - length :]).logits[0]
                    for row, length in enumerate(left_padded_lengths(attention_mask, input_ids))
                ]
                logits = rows[0].new_zeros(*input_ids.shape, rows[0].shape[-1])  # [B, T, V]
                for row, row_logits in enumerate(rows):
                    logits[row, width - row_logits.shape[0] :] = row_logits
        loss = None if labels is None else causal_lm_loss(logits, labels.to(logits.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

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
        max_length), do_sample, temperature, top_k, top_p, eos_token_id (an id or a list),
        pad_token_id. A left-padding attention_mask is masked by a DRT session (one session for
        the batch); other models run each row's real tokens in a session of its own, the rows
        stepped together. The output keeps the prompt's pads, and rows that ended early are
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
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = check_left_padding(attention_mask, input_ids)
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
            "top_k": config.top_k or None if sample else None,
            "top_p": config.top_p if sample and config.top_p is not None and config.top_p < 1 else None,
            "eos_token_ids": sorted(eos_ids),
            "pad_token_id": int(pad),
        }


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
