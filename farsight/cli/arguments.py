"""What several commands share: the --model, --memory, JSON output and needle-grid arguments, and reading them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from farsight.errors import InputError

T = TypeVar("T")

MODEL_HELP = "model directory or training run directory"


def add_model_argument(parser: argparse.ArgumentParser, *, default: str | None = None, repeatable: bool = False) -> None:
    """--model: required unless `default` is given; `repeatable` collects one path per --model."""
    if repeatable:
        parser.add_argument("--model", action="append", required=True, help=f"{MODEL_HELP} (repeat to compare)")
    else:
        parser.add_argument("--model", required=default is None, default=default, help=MODEL_HELP)


class _LazyChoices(Sequence[str]):
    """The names in the table `farsight.models.<table>`, imported when first read: farsight.models
    loads torch, which `farsight --help` should not wait for."""

    def __init__(self, table: str) -> None:
        self.table = table

    def _names(self) -> list[str]:
        import farsight.models

        return list(getattr(farsight.models, self.table))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())


def add_memory_argument(parser: argparse.ArgumentParser) -> None:
    """--memory and --kv-dtype: where a DRT keeps its chunk memory (farsight.models.MEMORY_TIERS)
    and the dtype its K/V are stored in (farsight.models.KV_DTYPES)."""
    # choices are set after add_argument, which formats them at once (and so would import torch)
    memory = parser.add_argument("--memory", default="device", help="DRT chunk memory tier")
    memory.choices = _LazyChoices("MEMORY_TIERS")
    kv_dtype = parser.add_argument(
        "--kv-dtype", default=None, help="dtype of DRT's stored chunk K/V (default: the model's; bf16/fp16 halve an fp32 model's memory)"
    )
    kv_dtype.choices = _LazyChoices("KV_DTYPES")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype: the dtype the model is cast to for evaluation (farsight.models.MODEL_DTYPES)."""
    dtype = parser.add_argument("--dtype", default="fp32", help="run the model in this dtype (bf16 is ~4x faster on CPUs with AVX-512 bf16)")
    dtype.choices = _LazyChoices("MODEL_DTYPES")


def add_json_output_argument(parser: argparse.ArgumentParser, flag: str = "--out", what: str = "the results") -> None:
    """An optional path (`flag`) that `what` is written to as JSON."""
    parser.add_argument(flag, help=f"write {what} as JSON")


def add_needle_grid_arguments(parser: argparse.ArgumentParser, *, lengths: str, trials: int, long_trials: int | None) -> None:
    """--lengths, --depths, --trials and --long-trials: the length x depth grid of a needle evaluation."""
    parser.add_argument("--lengths", default=lengths, help="comma-separated lengths, e.g. 1k,16k,1m (k = 1024)")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--trials", type=int, default=trials, help="trials per (length, depth) cell")
    long_default = "--trials" if long_trials is None else "%(default)s"
    parser.add_argument(
        "--long-trials", type=int, default=long_trials, help=f"trials per cell for lengths above 64K (default: {long_default})"
    )


def parse_list(text: str, convert: Callable[[str], T], option: str, what: str) -> list[T]:
    """The comma-separated items of `text`, each converted; an unreadable item is an InputError naming `option`."""
    try:
        return [convert(item) for item in text.split(",")]
    except ValueError as exc:
        raise InputError(f"{option}={text!r} is not a comma-separated list of {what}: {exc}") from exc


def needle_grid(args: argparse.Namespace) -> tuple[list[int], list[float], dict[int, int]]:
    """The lengths, depths and trials per length that the needle-grid arguments ask for."""
    from farsight.eval.needle import parse_length, trials_per_length

    lengths = parse_list(args.lengths, parse_length, "--lengths", "lengths")
    depths = parse_list(args.depths, float, "--depths", "numbers")
    return lengths, depths, trials_per_length(lengths, args.trials, args.long_trials)


def load_model_and_tokenizer(path: str, dtype: str = "fp32") -> tuple[Any, Any]:
    """The model (in eval mode, cast to `dtype`) and the tokenizer of the model or run directory `path`."""
    from farsight.data.tokenizers import load_tokenizer
    from farsight.models import MODEL_DTYPES, load_model, resolve_model_dir

    directory = resolve_model_dir(path)
    return load_model(directory).to(MODEL_DTYPES[dtype]).eval(), load_tokenizer(directory)
