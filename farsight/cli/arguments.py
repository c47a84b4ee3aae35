"""What several commands share: the --model, --memory, JSON output, lengths and needle-grid
arguments, reading them, and the checks every command runs on them before any work starts."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from farsight.errors import InputError
from farsight.files import can_create_in

logger = logging.getLogger(__name__)

T = TypeVar("T")

MODEL_HELP = "model directory or training run directory"
MAX_LENGTH = 64 << 20  # longer evaluation lengths need --allow-long: 1e9 is more likely a typo than a plan


def add_model_argument(
    parser: argparse.ArgumentParser, *, default: str | None = None, repeatable: bool = False
) -> None:
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
        "--kv-dtype",
        default=None,
        help="dtype of DRT's stored chunk K/V (default: the model's; bf16/fp16 halve an fp32 model's memory)",
    )
    kv_dtype.choices = _LazyChoices("KV_DTYPES")


def add_retrieval_reading_arguments(parser: argparse.ArgumentParser) -> None:
    """--retrieval-top-k and --retrieval-neighbors: how many past chunks a DRT reads per query
    chunk (`set_retrieval_top_k`) and which chunks beside each it reads too
    (`set_retrieval_neighbors`)."""
    parser.add_argument(
        "--retrieval-top-k",
        type=int,
        default=None,
        metavar="K",
        help="a DRT reads the K best past chunks per chunk instead of the top_k it was trained with "
        "(recorded in --out); fewer can read a single needle more exactly",
    )
    parser.add_argument(
        "--retrieval-neighbors",
        default=None,
        metavar="N|BEFORE:AFTER",
        help="a DRT also reads the chunks just before and after each retrieved one (N on each side, "
        "or BEFORE:AFTER; recorded in --out), so that evidence split over two chunks is read whole",
    )


def retrieval_reading(args: argparse.Namespace) -> dict[str, Any]:
    """The reading options given on the command line, as `load_model_and_tokenizer` and
    `measured_on` take them (--retrieval-neighbors checked here, before any model loads)."""
    from farsight.models import parse_neighbors

    reading: dict[str, Any] = {}
    if args.retrieval_top_k is not None:
        reading["retrieval_top_k"] = args.retrieval_top_k
    if args.retrieval_neighbors is not None:
        reading["retrieval_neighbors"] = parse_neighbors(args.retrieval_neighbors)
    return reading


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype: the dtype the model is cast to for evaluation (farsight.models.MODEL_DTYPES)."""
    dtype = parser.add_argument(
        "--dtype",
        default="fp32",
        help="run the model in this dtype (bf16 is ~4x faster than fp32 on CPUs with bf16 instructions; on CPUs without, bf16/fp16 products run as fp32 GEMMs)",
    )
    dtype.choices = _LazyChoices("MODEL_DTYPES")
    # `farsight` runs the command's CPU products in this dtype widened where the CPU lacks them
    parser.set_defaults(widen_cpu_matmuls=True)


def add_json_output_argument(parser: argparse.ArgumentParser, flag: str = "--out", what: str = "the results") -> None:
    """An optional path (`flag`) that `what` is written to as JSON."""
    parser.add_argument(flag, help=f"write {what} as JSON")


def add_lengths_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """--lengths and --allow-long: the evaluation lengths, capped at MAX_LENGTH unless --allow-long."""
    parser.add_argument("--lengths", default=default, help="comma-separated lengths, e.g. 1k,16k,1m (k = 1024)")
    parser.add_argument("--allow-long", action="store_true", help="allow lengths above 64M tokens")


def add_needle_grid_arguments(
    parser: argparse.ArgumentParser, *, lengths: str, trials: int, long_trials: int | None
) -> None:
    """--lengths, --allow-long, --depths, --trials and --long-trials: the length x depth grid of a needle evaluation."""
    add_lengths_argument(parser, lengths)
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--trials", type=int, default=trials, help="trials per (length, depth) cell")
    long_default = "--trials" if long_trials is None else "%(default)s"
    parser.add_argument(
        "--long-trials",
        type=int,
        default=long_trials,
        help=f"trials per cell for lengths above 64K (default: {long_default})",
    )


def text_argument(text: str, flag: str) -> str:
    """A text option as typed: bytes of the command line that are not valid UTF-8 (Python keeps
    them as lone surrogates, which no tokenizer encodes) become U+FFFD, with a note saying how many."""
    raw = text.encode("utf-8", errors="surrogateescape")
    fixed = raw.decode("utf-8", errors="replace")
    if fixed != text:
        invalid = sum(1 for char in text if "\udc80" <= char <= "\udcff")
        logger.warning(f"note: {flag}: {invalid} byte{'s' if invalid != 1 else ''} not valid UTF-8, read as U+FFFD")
    return fixed


def parse_list(text: str, convert: Callable[[str], T], option: str, what: str) -> list[T]:
    """The comma-separated items of `text`, each converted; an unreadable item, or one listed twice
    (a grid would merge or repeat it), is an InputError naming `option`."""
    try:
        items = [convert(item) for item in text.split(",")]
    except ValueError as exc:
        raise InputError(f"{option}={text!r} is not a comma-separated list of {what}: {exc}") from exc
    repeated = next((item for index, item in enumerate(items) if item in items[:index]), None)
    if repeated is not None:
        raise InputError(f"{option}={text!r} lists {repeated} twice; list each once")
    return items


def parse_labels(
    text: str | None, paths: list[str], what: str, default: Callable[[Path], str], unique: bool
) -> list[str]:
    """--labels: one name per path in `paths` (the `what`), stripped and not empty; without it
    `default(path)` for each, or the paths themselves where those defaults collide. With `unique`
    two paths may not share a name (seeds of one model may, in a legend)."""
    if text is None:
        labels = [default(Path(path)) for path in paths]
        return labels if len(set(labels)) == len(labels) and all(labels) else [str(path) for path in paths]
    labels = [label.strip() for label in text.split(",")]
    if len(labels) != len(paths):
        raise InputError(
            f"--labels names {len(labels)} for {len(paths)} {what}; give one label per path, separated by commas"
        )
    if not all(labels):
        raise InputError(f"--labels={text!r} has an empty name; give every one of the {len(paths)} {what} a name")
    if unique and len(set(labels)) != len(labels):
        raise InputError(f"--labels={text!r} names two {what} alike; each needs its own name")
    return labels


def parse_lengths(args: argparse.Namespace, minimum: int = 1) -> list[int]:
    """The --lengths asked for, each at least `minimum` and at most MAX_LENGTH unless --allow-long."""
    from farsight.eval.needle import format_length, parse_length

    lengths = parse_list(args.lengths, parse_length, "--lengths", "lengths")
    for length in lengths:
        if length < minimum:
            raise InputError(
                f"--lengths {length} is too short; this evaluation needs lengths of at least {minimum} tokens"
            )
        if length > MAX_LENGTH and not args.allow_long:
            raise InputError(
                f"--lengths {length} is above {format_length(MAX_LENGTH)} tokens; pass --allow-long if you mean it"
            )
    return lengths


def needle_grid(args: argparse.Namespace) -> tuple[list[int], list[float], dict[int, int]]:
    """The lengths, depths and trials per length that the needle-grid arguments ask for."""
    from farsight.eval.needle import check_needle_grid, trials_per_length

    lengths = parse_lengths(args)
    depths = parse_list(args.depths, float, "--depths", "numbers")
    trials = trials_per_length(lengths, args.trials, args.long_trials)
    return lengths, depths, check_needle_grid(lengths, depths, trials, ("--lengths", "--depths", "--trials"))


MAX_SEED = 2**63 - 1  # the largest seed torch's generators take


def check_at_least(args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Each option (flag -> smallest allowed value) that was given must be at least its minimum
    (and a --seed at most MAX_SEED)."""
    for flag, minimum in minimums.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < minimum:
            raise InputError(f"{flag} must be at least {minimum}, got {value}")
        if flag == "--seed" and value is not None and value > MAX_SEED:
            raise InputError(f"--seed must be at most {MAX_SEED} (2**63 - 1), got {value}")


def check_number(
    args: argparse.Namespace, flag: str, low: float, high: float | None = None, *, open_low: bool = False
) -> None:
    """The number option `flag`, if given, must be finite and within [low, high] (`open_low`:
    above low); the error names the range."""
    import math

    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None:
        return
    above = value > low if open_low else value >= low
    if not math.isfinite(value) or not above or (high is not None and value > high):
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]" if high is not None else None
        wanted = f"in {bounds}" if bounds else f"a finite number {'above' if open_low else 'of at least'} {low:g}"
        raise InputError(f"{flag} must be {wanted}, got {value}")


# the options (and their defaults) that only an evaluation reads, not an export of its tasks
EVALUATION_ONLY = {
    "--out": None,
    "--plot": None,
    "--memory": "device",
    "--kv-dtype": None,
    "--dtype": "fp32",
    "--retrieval-top-k": None,
    "--retrieval-neighbors": None,
    "--batch-size": 1,
}


def refuse_unused(args: argparse.Namespace, defaults: dict[str, object], why: str) -> None:
    """Refuse options the chosen mode does not read (`defaults`: flag -> its default), when given
    another value: an option that is silently ignored reads as one that took effect."""
    given = [flag for flag, default in defaults.items() if getattr(args, flag[2:].replace("-", "_")) != default]
    if given:
        them = "it" if len(given) == 1 else "them"
        raise InputError(f"{' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect {why}; drop {them}")


_OUTPUT_FILES: dict[Path, str] = {}  # the output files this command's checks have named, and by which flag


def output_files_named() -> dict[Path, str]:
    """The output files the running command has checked so far (resolved path -> flag)."""
    return _OUTPUT_FILES


def check_output_file(path: str | None, flag: str) -> None:
    """The file `flag` names can be written: it is not a folder, its nearest existing folder is
    writable, and no other output option of the command names it (one would overwrite the other)."""
    if path is not None:
        named = _OUTPUT_FILES.setdefault(Path(path).resolve(), flag)
        if named != flag:
            raise InputError(f"{named} and {flag} name the same file {path}; give each its own path")
        if Path(path).is_dir():
            raise InputError(f"{flag} {path} is a folder; pass a file path")
        _check_writable_folder(Path(path).parent, flag, path)


def check_plot_file(path: str | None, flag: str = "--plot") -> None:
    """Like check_output_file, and the file's extension is an image format matplotlib writes
    (no extension: PNG), so a long evaluation does not end in matplotlib's traceback."""
    check_output_file(path, flag)
    suffix = Path(path).suffix.lstrip(".").lower() if path is not None else ""
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        if suffix not in formats:
            raise InputError(
                f"{flag} {path}: matplotlib cannot write .{suffix} files; use one of .{', .'.join(formats)}"
            )


def check_output_folder(path: str, flag: str) -> None:
    """The folder `flag` names is, or can be made as, a writable folder."""
    _check_writable_folder(Path(path), flag, path)


def _check_writable_folder(folder: Path, flag: str, path: str) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(
            f"{flag} {path} cannot be written: {existing} is not a folder; pass a path in a writable folder"
        )
    refused = can_create_in(existing)
    if refused is not None:
        raise InputError(
            f"{flag} {path} cannot be written: {existing} refuses new files ({refused.strerror or refused}); "
            "pass a path in a writable folder"
        )


def add_force_argument(parser: argparse.ArgumentParser, what: str, flag: str = "--out") -> None:
    """--force: write `what` into the output folder `flag` names even when it holds something else
    (a model, a tokenizer, a run, other files), which is refused without it (`claim_output`)."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"write {what} into {flag} even when it holds something else (a model, a tokenizer, a run, other files)",
    )


def claim_output(path: str, kind: str, force: bool, flag: str = "--out") -> None:
    """Refuse, before any work starts, to write `kind` (a key of farsight.files.FOLDER_KINDS) into
    the folder `flag` names when it holds something else and --force is not given."""
    from farsight.files import claim_output_folder

    claim_output_folder(path, kind, force, name=f"{flag} {path}")


def model_tokenizer(path: str) -> Any:
    """The tokenizer of the model or run directory `path`, without loading the model (refused when
    it has more tokens than the model's vocabulary)."""
    from farsight.models.registry import load_model_tokenizer

    return load_model_tokenizer(path)


def model_chunk_size(path: str) -> int:
    """The DRT chunk size of the model or run directory `path` (1 for models without chunks),
    read from its config without loading the weights: the default question alignment."""
    from farsight.models import read_model_meta, resolve_model_dir

    return int(read_model_meta(resolve_model_dir(path))["config"].get("chunk_size", 1))


def open_corpus(corpus: str, split: str, model_paths: Sequence[str]) -> Any:
    """`split` of the prepared dataset `corpus`, insisting it was prepared with every model's tokenizer."""
    from farsight.data.token_files import load_token_dataset

    data = load_token_dataset(corpus, split)
    for path in model_paths:
        if model_tokenizer(path).to_spec() != data.tokenizer.to_spec():
            raise InputError(
                f"{corpus} was prepared with another tokenizer than the model {path}'s, so its scores would mean nothing; "
                f"pass --corpus with a dataset prepared with `farsight data prepare --tokenizer {path} ...`"
            )
    return data


def load_model_and_tokenizer(
    path: str,
    dtype: str = "fp32",
    retrieval_top_k: int | None = None,
    retrieval_neighbors: tuple[int, int] | None = None,
) -> tuple[Any, Any]:
    """The model (in eval mode, cast to `dtype`, reading `retrieval_top_k` chunks and their
    `retrieval_neighbors` when given) and the tokenizer of the model or run directory `path`."""
    import torch

    from farsight.models import (
        MODEL_DTYPES,
        load_model,
        resolve_model_dir,
        set_retrieval_neighbors,
        set_retrieval_top_k,
    )
    from farsight.models.registry import load_model_tokenizer
    from farsight.train.precision import software_dtype_reason

    reason = software_dtype_reason(MODEL_DTYPES[dtype], torch.device("cpu"))
    if reason is not None:
        logger.warning(
            f"note: {reason}: --dtype {dtype} runs its matrix products as fp32 GEMMs, no faster than --dtype fp32"
        )
    directory = resolve_model_dir(path)
    model = load_model(directory)
    if retrieval_top_k is not None:
        set_retrieval_top_k(model, retrieval_top_k)
    if retrieval_neighbors is not None:
        set_retrieval_neighbors(model, retrieval_neighbors)
    tokenizer = load_model_tokenizer(directory, model.config.vocab_size)
    return model.to(MODEL_DTYPES[dtype]).eval(), tokenizer


def measured_on(
    path: str, retrieval_top_k: int | None = None, retrieval_neighbors: tuple[int, int] | None = None
) -> dict[str, Any]:
    """What a results file records of the model it measured: the path given, the SHA-256 of the
    trained weights behind it (`farsight.models.io.trained_weights`), by which a model card knows
    a result measured on one export of a checkpoint holds for another, and how a DRT read when
    told otherwise than by its config: the chunks per query chunk (`--retrieval-top-k`) and the
    neighbors read beside each, as [before, after] (`--retrieval-neighbors`)."""
    from farsight.models.io import trained_weights

    measured: dict[str, Any] = {"model": str(path), "trained_weights": trained_weights(path)}
    if retrieval_top_k is not None:
        measured["retrieval_top_k"] = retrieval_top_k
    if retrieval_neighbors is not None:
        measured["retrieval_neighbors"] = list(retrieval_neighbors)
    return measured


def parse_task_options(items: list[str]) -> dict[str, object]:
    """--task-option KEY=VALUE strings as a dict, each value read as YAML (7 is a number, uuids a
    string, [a, b] a list)."""
    import yaml

    options = {}
    for item in items:
        key, separator, text = item.partition("=")
        if not separator:
            raise InputError(f"--task-option expects KEY=VALUE (e.g. digits=7), got {item!r}")
        try:
            options[key] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InputError(f"--task-option {item!r}: the value is not valid YAML ({exc})") from exc
    return options


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def check_memory_tier(path: str, memory: str, kv_dtype: str | None) -> None:
    """Refuse --memory other than device, or --kv-dtype, for a model without DRT's chunk memory
    (read from its config, before it loads): a transformer keeps its caches on the device."""
    from farsight.models import read_model_meta, resolve_model_dir
    from farsight.models.transformer import refuse_chunk_memory

    meta = read_model_meta(resolve_model_dir(path))
    if meta["model_type"] != "drt":
        attention = meta["config"].get("attention", "causal")
        refuse_chunk_memory(attention, memory, kv_dtype, names="--memory and --kv-dtype", fix=f"drop them for {path}")


def session_bytes_per_token(path: str, memory: str, kv_dtype: str | None, dtype: str) -> tuple[float, float, str]:
    """(RAM bytes, disk bytes, what) that a decoding session of the model at `path` keeps per
    prompt token, read from its config without loading it: a DRT's chunk memory (K/V of every
    token in the tier `memory`, landmark keys in RAM), a transformer's KV cache (none that grows
    under sliding attention). A lower bound: buffers that grow by doubling may hold up to twice it."""
    import torch

    from farsight.models import KV_DTYPES, MODEL_DTYPES, read_model_meta, resolve_model_dir

    check_memory_tier(path, memory, kv_dtype)
    meta = read_model_meta(resolve_model_dir(path))
    config = meta["config"]
    d_model = int(config.get("d_model", 256))
    heads = int(config.get("n_heads", 4))
    head_dim = int(config.get("head_dim") or d_model // heads)
    model_bytes = torch.empty(0, dtype=MODEL_DTYPES[dtype]).element_size()
    kv_bytes = torch.empty(0, dtype=KV_DTYPES[kv_dtype]).element_size() if kv_dtype else model_bytes
    if meta["model_type"] == "drt":
        kv = 2 * heads * head_dim * kv_bytes
        landmarks = d_model * model_bytes / int(config.get("chunk_size", 64))
        what = f"DRT chunk memory in --memory {memory}: {kv + landmarks:,.0f} bytes per token"
        return (landmarks, kv, what) if memory == "disk" else (kv + landmarks, 0.0, what)
    attention = config.get("attention", "causal")
    if attention == "sliding":
        return 0.0, 0.0, "sliding-window KV cache"
    per_layer = 2 * heads * head_dim * model_bytes * (2 if attention.startswith("castle") else 1)
    layers = int(config.get("n_layers", 4))
    return layers * per_layer, 0.0, f"{attention} KV cache: {layers * per_layer:,.0f} bytes per token"


def check_memory_for(args: argparse.Namespace, lengths: list[int], trials: dict[int, int]) -> None:
    """Refuse (InputError), before any work, lengths whose haystacks and session would not fit in
    the memory (and, for --memory disk, the temporary folder's free space) there is: each trial's
    prompt is held as int64 ids (8 bytes a token) while its cell runs, beside the batch being
    decoded and the model's memory tier (`session_bytes_per_token`)."""
    import shutil
    import tempfile

    import psutil

    ram_per_token, disk_per_token, what = (
        session_bytes_per_token(
            args.model,
            getattr(args, "memory", "device"),
            getattr(args, "kv_dtype", None),
            getattr(args, "dtype", "fp32"),
        )
        if getattr(args, "model", None)
        else (0.0, 0.0, "no model")
    )
    batch = getattr(args, "batch_size", 1) or 1
    available = psutil.virtual_memory().available
    free_disk = shutil.disk_usage(tempfile.gettempdir()).free
    for length in sorted(lengths, reverse=True):
        rows = min(batch, trials[length])
        haystack = length * 8 * (trials[length] + rows)
        ram = haystack + length * rows * ram_per_token
        disk = length * rows * disk_per_token
        if ram > available:
            raise InputError(
                f"--lengths {length:,} needs about {_bytes(ram)} of memory (haystacks: {length:,} tokens x 8 bytes "
                f"x ({trials[length]} trial{'s' if trials[length] != 1 else ''} + {rows} decoded at once); {what}), "
                f"more than the {_bytes(available)} available; "
                "pass shorter --lengths or fewer --trials"
                + (", or --memory disk" if ram_per_token > 0 and disk_per_token == 0 and "DRT" in what else "")
            )
        if disk > free_disk:
            raise InputError(
                f"--lengths {length:,} needs about {_bytes(disk)} of disk for the {what}, more than the "
                f"{_bytes(free_disk)} free in {tempfile.gettempdir()}; pass shorter --lengths or --memory host"
            )
