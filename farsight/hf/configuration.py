"""Hugging Face configs over farsight's config.json, one per farsight model type.

farsight writes `{"model_type": "drt", "farsight_version": ..., "config": {...}}`; the HF config
keeps that layout (the farsight config stays a dict under `config`), so `AutoConfig.from_pretrained`
reads a farsight model directory as it is. `memory` and `kv_dtype` are the DRT session options
that `generate` and the lm-eval adapter use; they are load-time options, not part of config.json.

The sizes tools read from a Hugging Face config (`vocab_size`, `hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `max_position_embeddings`) are read-only views of the farsight config.
No farsight model has a table of positions: RoPE tables grow on demand, ALiBi and sliding
windows are relative, and a session streams any number of tokens. `max_position_embeddings`
is therefore UNBOUNDED_POSITIONS (2^30) for every model, so that a tool that truncates its
inputs to it (lm-eval's "hf" model does) never truncates. A sliding-window transformer gives
its window as `sliding_window`, the attribute transformers' own sliding-window models use.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig

from farsight.config import ConfigBase
from farsight.errors import ConfigError
from farsight.models import KV_DTYPES, MEMORY_TIERS, MODEL_DTYPES, MODEL_TYPES
from farsight.models.transformer import refuse_chunk_memory

# max_position_embeddings of every farsight model (module docstring): far more tokens than any
# context farsight has been run on (16M), and still an int32
UNBOUNDED_POSITIONS = 2**30


class FarsightConfig(PreTrainedConfig):
    """Base of the farsight configs: `config` is farsight's own config dict (config.json's
    "config" entry), `memory`/`kv_dtype` select DRT's chunk-memory tier and K/V dtype."""

    config: dict[str, Any] | None = None
    farsight_version: str | None = None
    memory: str = "device"
    kv_dtype: str | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        # farsight's dtype names ("bf16") next to HF's (torch.bfloat16, "bfloat16"); a name of no
        # dtype at all is refused here, where transformers would fail on torch's missing attribute
        if isinstance(self.dtype, str) and self.dtype in MODEL_DTYPES:
            self.dtype = MODEL_DTYPES[self.dtype]
        elif isinstance(self.dtype, str) and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            resolve_dtype(self.dtype)  # "auto" passes
        kwargs.pop("model_type", None)  # the class's own; config.json repeats it
        super().__post_init__(**kwargs)
        if self.config is None:
            self.config = MODEL_TYPES[self.model_type].config_class().to_dict()
        self.farsight_config()  # refuse an invalid farsight config now, not at model build

    def farsight_config(self) -> ConfigBase:
        """The farsight config object (DRTConfig, TransformerConfig) this config holds."""
        return MODEL_TYPES[self.model_type].config_class.from_dict(self.config, where="config")

    def session_options(self, memory: str | None = None, kv_dtype: str | None = None) -> dict[str, Any]:
        """The `new_session` options: `memory`/`kv_dtype` if given, else this config's; checked."""
        memory = self.memory if memory is None else memory
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        if memory not in MEMORY_TIERS:
            raise ConfigError(f"memory={memory!r} is not a chunk-memory tier; choose one of {list(MEMORY_TIERS)}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={kv_dtype!r} is unknown; choose one of {list(KV_DTYPES)} or leave it unset")
        if self.model_type != "drt":
            refuse_chunk_memory(self.config.get("attention", "causal"), memory, kv_dtype, names="memory and kv_dtype")
        return {"memory": memory, "kv_dtype": kv_dtype}

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.config["d_model"]

    @property
    def num_hidden_layers(self) -> int:
        return self.config["n_layers"]

    @property
    def num_attention_heads(self) -> int:
        return self.config["n_heads"]

    @property
    def max_position_embeddings(self) -> int:
        """UNBOUNDED_POSITIONS: a farsight model reads any number of tokens (module docstring)."""
        return UNBOUNDED_POSITIONS

    @property
    def sliding_window(self) -> int | None:
        """The attention window of a sliding-window transformer; None for full attention (CASTLE-SWL
        included: its window bounds lookahead, not attention) and for a DRT, whose retrieval
        reads past its lower layers' window."""
        if self.model_type == "drt":
            return None
        return self.config.get("window")


class FarsightDRTConfig(FarsightConfig):
    """A farsight DRT (farsight.models.DRTForCausalLM) as a Hugging Face config."""

    model_type = "drt"


class FarsightTransformerConfig(FarsightConfig):
    """A farsight transformer (causal, sliding, castle, castle-swl attention) as a Hugging Face config."""

    model_type = "transformer"


CONFIG_CLASSES: dict[str, type[FarsightConfig]] = {
    cls.model_type: cls for cls in (FarsightDRTConfig, FarsightTransformerConfig)
}


def resolve_dtype(value: Any) -> torch.dtype | None:
    """A dtype given as torch.dtype, farsight's name ("bf16") or HF's ("bfloat16"); None for None/"auto"."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype) and value in MODEL_DTYPES.values():
        return value
    if value in MODEL_DTYPES:
        return MODEL_DTYPES[value]
    named = getattr(torch, str(value), None)
    if isinstance(named, torch.dtype) and named in MODEL_DTYPES.values():
        return named
    raise ConfigError(
        f"dtype={value!r} is not one farsight runs in; choose one of {list(MODEL_DTYPES)} (or the torch dtype)"
    )
