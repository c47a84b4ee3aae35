"""Synthetic long-context tasks: needle-in-a-haystack generators, fillers and training batches."""

from farsight.data.tasks.filler import CorpusFiller, Filler, RepeatedFiller, make_filler
from farsight.data.tasks.needles import (
    TASKS,
    MultiKeyTask,
    NeedleSample,
    NeedleTask,
    PasskeyTask,
    TwoHopTask,
    make_task,
)
from farsight.data.tasks.training import NeedleBatchConfig, NeedleBatches

__all__ = [
    "TASKS",
    "CorpusFiller",
    "Filler",
    "MultiKeyTask",
    "NeedleBatchConfig",
    "NeedleBatches",
    "NeedleSample",
    "NeedleTask",
    "PasskeyTask",
    "RepeatedFiller",
    "TwoHopTask",
    "make_filler",
    "make_task",
]
