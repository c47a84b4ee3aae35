"""Dataclass configs that validate themselves and reject unknown keys with a suggestion."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from typing import Any, TypeVar

from farsight.errors import ConfigError

__all__ = ["ConfigBase", "ConfigError", "require"]

T = TypeVar("T", bound="ConfigBase")


@dataclasses.dataclass
class ConfigBase:
    """Base for configs: `from_dict` checks keys and types, `validate` checks values."""

    def __post_init__(self) -> None:
        # the types YAML loading checks hold for a config built in Python too (gumbel="false" is
        # no boolean); from_dict has checked them already, naming the section
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(getattr(self, f.name), f.type, f"{type(self).__name__}.{f.name}"))
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError for an invalid value. Subclasses extend this."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
        prefix = f"{where}." if where else ""
        if not isinstance(data, dict):
            raise ConfigError(
                f"{where or cls.__name__} must be a mapping of field names to values, got {type(data).__name__}"
            )
        names = cls.field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid fields: {', '.join(names)}"
            raise ConfigError(f"unknown config field '{prefix}{key}' for {cls.__name__}{hint}")
        kwargs = {}
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, value in data.items():
            kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Light type checking for values read from JSON/YAML (ints for floats are fine, not the reverse)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    allows_none = "None" in text or "Optional" in text
    if value is None:
        if allows_none:
            return None
        raise ConfigError(f"{name} must not be null")
    base = text.replace("| None", "").replace("None |", "").strip()
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    elif base == "int":
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
            if math.isfinite(value) and float(value).is_integer():  # 1e3 and 5E4 read as floats in YAML
                return int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(value)
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    elif base == "str":
        if isinstance(value, os.PathLike):  # a path field given as a Path
            return os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
