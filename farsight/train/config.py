"""Training configuration: a YAML file with sections model / data / optim / train, plus --set
overrides; `base: other.yaml` starts from another config and changes only what the file names."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from farsight.config import ConfigBase, ConfigError, require
from farsight.errors import MissingFileError

logger = logging.getLogger(__name__)

SECTIONS = ("model", "data", "optim", "train")
BASE_KEY = "base"
# the key that says what a section is, and its value when left out: naming another value in a
# config replaces the base's section
SECTION_KINDS = {"model": ("type", None), "data": ("kind", "tokens")}


class _Loader(yaml.SafeLoader):
    """YAML 1.1 with YAML 1.2's floats: 1e-3 and 5E4 are numbers (1.1 reads them as strings), and
    a key given twice in one mapping refused (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges are PyYAML's to resolve
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class _EmptyValue:
    """What a key with nothing after its colon reads as in a config file (`train:` with its fields
    commented out), told apart from an explicit `null` / `~` until the base is laid under it."""

    def __repr__(self) -> str:
        return "nothing"


_EMPTY = _EmptyValue()


class _FileLoader(_Loader):
    """_Loader for config files: a value left empty is `_EMPTY`, an explicit null is None."""


_FileLoader.add_constructor(
    "tag:yaml.org,2002:null", lambda loader, node: _EMPTY if node.value == "" else loader.construct_yaml_null(node)
)


def _parse_yaml(text: str, what: str, loader: type[yaml.SafeLoader] = _Loader) -> Any:
    """`text` parsed as YAML; a syntax error is a one-line ConfigError naming `what` and where."""
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        fix = (
            "keep one of them"
            if "given twice" in problem
            else "fix the syntax (quote strings that contain : [ ] { } #)"
        )
        raise ConfigError(f"{what} is not valid YAML ({problem}{where}); {fix}") from exc


def _home_expanded(section: Any, fields: tuple[str, ...]) -> Any:
    """A section with `~` expanded in its path `fields`, as a shell expands it on the command line
    (a config file or --set passes it through as text, which would name a folder called `~`)."""
    if not isinstance(section, dict):
        return section
    return {k: os.path.expanduser(v) if k in fields and isinstance(v, str) else v for k, v in section.items()}


PRECISIONS = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16")


@dataclass
class OptimConfig(ConfigBase):
    """AdamW with linear warmup and cosine decay to min_lr."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0

    def validate(self) -> None:
        require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        require(
            self.grad_clip is None or self.grad_clip > 0, f"optim.grad_clip must be > 0 or null, got {self.grad_clip}"
        )


@dataclass
class RunConfig(ConfigBase):
    """The `train` section: length, batching, logging, checkpoints, devices.

    init_from: a model directory or training run whose weights start a fresh run (fine-tuning,
    as in the DRT paper's Appendix D); the architecture must match. A resumed run ignores it.
    precision: fp32, bf16-mixed, fp16-mixed, bf16 or auto (farsight.train.precision).
    compile: true, false or auto: torch.compile for the model's blocks and loss
    (farsight.train.compile; auto = on for CPU runs of at least 100 steps).
    activation_checkpointing: recompute each block's activations in the backward instead of
    keeping them (PretrainedLM.set_activation_checkpointing): less memory, a slower step.
    """

    steps: int = 1000
    grad_accum: int = 1
    seed: int = 0
    out_dir: str = "runs/default"
    log_interval: int = 10
    eval_interval: int = 200
    eval_batches: int = 8
    checkpoint_interval: int = 200
    keep_last: int = 3
    device: str = "auto"
    precision: str = "auto"
    compile: bool | str = "auto"
    activation_checkpointing: bool = False
    distributed: str = "ddp"
    tensorboard: bool = False
    progress: bool = True
    init_from: str | None = None

    def validate(self) -> None:
        for name in ("steps", "grad_accum", "log_interval", "eval_interval", "checkpoint_interval", "keep_last"):
            value = getattr(self, name)
            require(value >= 1, f"train.{name} must be >= 1, got {value}")
        require(self.eval_batches >= 0, f"train.eval_batches must be >= 0, got {self.eval_batches}")
        # numpy's and torch's generators take seeds in [0, 2**32)
        require(0 <= self.seed < 2**32, f"train.seed must be in [0, 2**32 - 1], got {self.seed}")
        require(
            self.precision in PRECISIONS,
            f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
        )
        require(
            self.distributed in ("ddp", "fsdp"), f"train.distributed must be 'ddp' or 'fsdp', got {self.distributed!r}"
        )
        require(
            isinstance(self.compile, bool) or self.compile == "auto",
            f"train.compile must be auto, true or false, got {self.compile!r}",
        )
        require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            f"train.device must be auto, cpu, cuda[:N] or mps, got {self.device!r}",
        )


@dataclass
class TrainConfig:
    """model and data stay dicts here: their schemas belong to the model type and the data kind."""

    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        if not isinstance(raw, dict):
            raise ConfigError("a training config must be a mapping with sections model, data, optim, train")
        unknown = [k for k in raw if k not in SECTIONS]
        if unknown:
            raise ConfigError(f"unknown config section '{unknown[0]}'; valid sections: {', '.join(SECTIONS)}")
        # a section that is null (`train: null`) holds no values: its defaults apply
        sections = {name: {} if raw.get(name) is None else raw[name] for name in SECTIONS}
        for name in ("model", "data"):
            require(
                isinstance(sections[name], dict),
                f"section '{name}' must be a mapping of field names to values, got {_kind(sections[name])}",
            )
        require("type" in sections["model"], "model.type is required (e.g. transformer or drt)")
        return cls(
            model=dict(sections["model"]),
            data=_home_expanded(sections["data"], ("path", "corpus")),
            optim=OptimConfig.from_dict(sections["optim"], where="optim"),
            train=RunConfig.from_dict(_home_expanded(sections["train"], ("out_dir", "init_from")), where="train"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "optim": self.optim.to_dict(), "train": self.train.to_dict()}


def _kind(value: Any) -> str:
    """What a YAML value is, in words: 'a list', 'a string'..."""
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number", dict: "a mapping"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings; values are parsed as YAML (numbers, bools, lists). A
    section or mapping that is null gets the key as its first value. As with a config's base, a
    model of another type (`--set model.type=...`) or data of another kind starts its section
    afresh, whatever the order of the strings: the other `--set` keys of that section apply on top."""
    if overrides and not isinstance(raw, dict):
        raise ConfigError(
            f"--set needs a config that is a mapping with sections {', '.join(SECTIONS)}, got {_kind(raw)}"
        )
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. train.steps=100), got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"--set key must start with a section ({', '.join(SECTIONS)}), got {key!r}")
        parsed.append((item, key, parts, _parse_yaml(text, f"--set {item}")))
    # the last value given for a section's type (kind) is the one that stays
    kinds = {parts[0]: (item, value) for item, _, parts, value in parsed if _names_section_kind(parts)}
    for section, (item, value) in kinds.items():
        _switch_section_kind(raw, section, value, item)
    for _, key, parts, value in parsed:
        node = raw
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = value
    return raw


def _another_kind(section: str, held: Any, value: Any) -> bool:
    """Whether `value` names another model type (data kind) than the mapping `held` of `section`
    has, its default when it names none: the one rule by which a config over a base and a --set
    start that section afresh."""
    key, default = SECTION_KINDS[section]
    return isinstance(held, dict) and held.get(key, default) != value


def _names_section_kind(parts: list[str]) -> bool:
    """Whether the --set key `parts` is a section's type or kind (model.type, data.kind)."""
    return len(parts) == 2 and SECTION_KINDS.get(parts[0], ("",))[0] == parts[1]


def _switch_section_kind(raw: dict[str, Any], section: str, value: Any, item: str) -> None:
    """Empty `raw[section]` when `value` names another model type (data kind) than it holds, as a
    base's section is replaced by a config naming another one; the fields it drops are logged."""
    held = raw.get(section)
    if not _another_kind(section, held, value):
        return
    key = SECTION_KINDS[section][0]
    dropped = sorted(name for name in held if name != key)
    if dropped:
        logger.info(
            f"--set {item} starts the {section} section afresh, as a config of another {key} would; "
            f"not used: {', '.join(dropped)} (set the ones it takes with --set {section}.NAME=VALUE)"
        )
    raw[section] = {}


def merge_config(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` laid over it: mappings merge key by key, anything else (numbers,
    strings, lists) is replaced whole."""
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = (
            merge_config(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def read_config_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The raw mapping of the config at `path`, with its `base:` chain resolved (a base path is
    relative to the file that names it)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        if chain:
            raise MissingFileError(
                f"{chain[-1]}: its base {path} {what}; fix the base path (relative to {chain[-1].parent})"
            )
        raise MissingFileError(
            f"config file {path} {what}; pass the path of a YAML file with sections model, data, optim, train"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass a YAML file") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path} ({exc.strerror}); check its permissions") from exc
    raw = _parse_yaml(text, str(path), _FileLoader)
    named = f"{chain[-1]}: its base {path}" if chain else str(path)
    if raw is None or raw is _EMPTY:
        raise ConfigError(
            f"{named} is empty; write the sections {', '.join(SECTIONS)} (or `base: other.yaml` and changes)"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{named} holds {_kind(raw)}, not a mapping; write the sections {', '.join(SECTIONS)} as `name:` lines"
        )
    if BASE_KEY not in raw:
        return _checked_sections(path, _settle_empty(raw, {}))
    base = raw.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        base = None if base is _EMPTY else base
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in chain or base_path == path.resolve():
        raise ConfigError(f"{path}: base {base} leads back to {base_path.name}; a config cannot be its own base")
    inherited = read_config_file(base_path, (*chain, path.resolve()))
    raw = _checked_sections(path, _settle_empty(raw, inherited))
    # a model of another type (a data section of another kind) shares no settings with the base's:
    # it replaces that section whole, so a DRT's chunk_size cannot reach a transformer built from it
    for section, (key, _) in SECTION_KINDS.items():
        mine = raw.get(section)
        if isinstance(mine, dict) and key in mine and _another_kind(section, inherited.get(section), mine[key]):
            inherited = {**inherited, section: {}}
    return merge_config(inherited, raw)


def _settle_empty(changes: dict[str, Any], inherited: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """`changes` without its empty values: a section or a mapping left empty (`train:` with its
    fields commented out) changes nothing, so it keeps what `inherited` (the base's values) holds
    there, or its defaults; any other value left empty is null, as YAML reads it. An explicit
    `null` stays null and so replaces the base's value (the way to reset it)."""
    settled: dict[str, Any] = {}
    for key, value in changes.items():
        below = inherited.get(key) if isinstance(inherited, dict) else None
        if value is _EMPTY:
            if depth == 0 and key in SECTIONS or isinstance(below, dict):
                continue
            value = None
        settled[key] = _settle_value(value, below, depth + 1)
    return settled


def _settle_value(value: Any, inherited: Any, depth: int) -> Any:
    if isinstance(value, dict):
        return _settle_empty(value, inherited if isinstance(inherited, dict) else {}, depth)
    if isinstance(value, list):
        return [None if item is _EMPTY else _settle_value(item, None, depth + 1) for item in value]
    return value


def _checked_sections(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw`, once each section in it is a mapping (or an explicit null, which resets it)."""
    for name in SECTIONS:
        value = raw.get(name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"{path}: section '{name}' must be a mapping of field names to values, got {_kind(value)}; "
                f"write its fields indented below `{name}:`, or leave it out"
            )
    return raw


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The config of the YAML file `path` (its `base:` chain laid under it) with `overrides`,
    a list of "section.key=value" strings as `farsight train --set` takes them."""
    if isinstance(overrides, (str, dict)):
        raise ConfigError(
            f"overrides are a list of 'section.key=value' strings, got a {type(overrides).__name__}; wrap it in [...]"
        )
    raw = read_config_file(Path(path))
    return TrainConfig.from_dict(apply_overrides(raw, overrides or []))


def dump_train_config(config: TrainConfig, path: Path) -> None:
    from farsight.train.checkpoint import write_text_atomically

    write_text_atomically(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


__all__ = [
    "PRECISIONS",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "dump_train_config",
    "load_train_config",
    "merge_config",
]
