"""Training batch sources by `data.kind`: the table of kinds and `build_batch_source`.

    tokens   random windows of a prepared token directory (farsight.data.token_batches)
    needle   synthetic needle tasks with a length curriculum (farsight.data.tasks.training)
    sft      supervised examples, the loss on their completions, batched by length (farsight.data.sft_batches)

A new kind is a config class and a `factory(config, seed, model_spec)` returning a `BatchSource`,
added to DATA_KINDS below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from farsight.config import ConfigBase, ConfigError
from farsight.data.batch_source import BatchSource
from farsight.data.sft_batches import SFTBatchConfig, SFTBatches
from farsight.data.tasks.training import NeedleBatchConfig, NeedleBatches
from farsight.data.token_batches import TokenBatchConfig, TokenBatches

DATA_KINDS: dict[str, tuple[type[ConfigBase], Callable[[Any, int, dict[str, Any]], BatchSource]]] = {
    "tokens": (TokenBatchConfig, TokenBatches),
    "needle": (NeedleBatchConfig, NeedleBatches),
    "sft": (SFTBatchConfig, SFTBatches),
}


def _data_config(data: dict[str, Any]) -> tuple[Any, Callable[[Any, int, dict[str, Any]], BatchSource]]:
    """The validated config of a training config's `data` section, and its kind's batch factory."""
    data = dict(data)
    kind = data.pop("kind", "tokens")
    if kind not in DATA_KINDS:
        raise ConfigError(f"data.kind={kind!r} is unknown; choose one of {sorted(DATA_KINDS)}")
    config_class, factory = DATA_KINDS[kind]
    return config_class.from_dict(data, where="data"), factory


def describe_data(data: dict[str, Any], steps: int | None = None) -> str:
    """One line saying what a training config's `data` section feeds the model over `steps` steps."""
    return _data_config(data)[0].describe(steps)


def build_batch_source(data: dict[str, Any], seed: int, model: dict[str, Any] | None = None) -> BatchSource:
    """The batch source for a training config's `data` section (`model` lets it read e.g. chunk_size)."""
    config, factory = _data_config(data)
    return factory(config, seed, model or {})
