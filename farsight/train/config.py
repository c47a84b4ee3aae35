"""Training configuration: a YAML file with sections model / data / optim / train, plus --set
overrides; `base: other.yaml` starts from another config and changes only what the file names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from farsight.config import ConfigBase, ConfigError, require
from farsight.errors import MissingFileError

SECTIONS = ("model", "data", "optim", "train")
BASE_KEY = "base"
# the key that says what a section is, and its value when left out: naming another value in a
# config replaces the base's section
SECTION_KINDS = {"model": ("type", None), "data": ("kind", "tokens")}


class _Loader(yaml.SafeLoader):
    """YAML 1.1 with YAML 1.2's floats: 1e-3 and 5E4 are numbers (1.1 reads them as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str, what: str) -> Any:
    """`text` parsed as YAML; a syntax error is a one-line ConfigError naming `what` and where."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"{what} is not valid YAML ({problem}{where}); fix the syntax (quote strings that contain : [ ] {{ }} #)"
        ) from exc


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
    distributed: str = "ddp"
    tensorboard: bool = False
    progress: bool = True
    init_from: str | None = None

    def validate(self) -> None:
        for name in ("steps", "grad_accum", "log_interval", "eval_interval", "checkpoint_interval", "keep_last"):
            value = getattr(self, name)
            require(value >= 1, f"train.{name} must be >= 1, got {value}")
        require(self.eval_batches >= 0, f"train.eval_batches must be >= 0, got {self.eval_batches}")
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
        for name in ("model", "data"):
            require(isinstance(raw.get(name, {}), dict), f"section '{name}' must be a mapping")
        require("type" in raw.get("model", {}), "model.type is required (e.g. transformer or drt)")
        return cls(
            model=dict(raw.get("model", {})),
            data=dict(raw.get("data", {})),
            optim=OptimConfig.from_dict(raw.get("optim") or {}, where="optim"),
            train=RunConfig.from_dict(raw.get("train") or {}, where="train"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "optim": self.optim.to_dict(), "train": self.train.to_dict()}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings; values are parsed as YAML (numbers, bools, lists)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. train.steps=100), got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"--set key must start with a section ({', '.join(SECTIONS)}), got {key!r}")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = _parse_yaml(text, f"--set {item}")
    return raw


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
    raw = _parse_yaml(text, str(path)) or {}
    if not isinstance(raw, dict) or BASE_KEY not in raw:
        return raw
    base = raw.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in chain or base_path == path.resolve():
        raise ConfigError(f"{path}: base {base} leads back to {base_path.name}; a config cannot be its own base")
    inherited = read_config_file(base_path, (*chain, path.resolve()))
    if not isinstance(inherited, dict):
        raise ConfigError(f"{path}: its base {base} is not a mapping with sections model, data, optim, train")
    # a model of another type (a data section of another kind) shares no settings with the base's:
    # it replaces that section whole, so a DRT's chunk_size cannot reach a transformer built from it
    for section, (key, default) in SECTION_KINDS.items():
        mine, theirs = raw.get(section), inherited.get(section)
        if (
            isinstance(mine, dict)
            and isinstance(theirs, dict)
            and key in mine
            and mine[key] != theirs.get(key, default)
        ):
            inherited = {**inherited, section: {}}
    return merge_config(inherited, raw)


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
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
