"""Checked readers of the files farsight writes and reads back later (a prepared dataset's
meta.json and token files, a run's metrics and checkpoints, a model's config): what is missing,
empty or damaged is refused in one line naming the file, what is wrong with it and the fix (e.g.
"prepare the dataset again"), never passed on as a traceback of json or numpy, nor trusted.

Each reader takes `fix`, the sentence that ends the message, and `error`, the FarsightError type
it raises (each caller has its own: TokenDataError, CheckpointError, ModelFileError...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farsight.errors import FarsightError, InputError

if TYPE_CHECKING:
    import numpy as np

ErrorType = type[FarsightError]


def refusal(path: str | os.PathLike, problem: str, fix: str, error: ErrorType = InputError) -> FarsightError:
    """The one-line error `error` of the file `path`: "PATH PROBLEM; FIX"."""
    return error(f"{path} {problem}; {fix}")


def check_file(path: Path, fix: str, error: ErrorType = InputError, *, empty_ok: bool = False) -> int:
    """Refuse a `path` that is missing, not a regular file or (unless `empty_ok`) empty; returns
    its size in bytes."""
    if not path.exists():
        raise refusal(path, "is missing", fix, error)
    if not path.is_file():
        raise refusal(path, "is a folder, not a file" if path.is_dir() else "is not a regular file", fix, error)
    size = path.stat().st_size
    if size == 0 and not empty_ok:
        raise refusal(path, "is empty", fix, error)
    return size


def read_text(path: Path, fix: str, error: ErrorType = InputError, *, empty_ok: bool = False) -> str:
    """The UTF-8 text of `path` (checked by `check_file`); unreadable or not UTF-8 is refused."""
    check_file(path, fix, error, empty_ok=empty_ok)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise refusal(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start}): corrupted", fix, error) from exc
    except OSError as exc:
        raise refusal(path, f"cannot be read ({exc.strerror or exc})", fix, error) from exc


def read_json(path: Path, fix: str, error: ErrorType = InputError, *, kind: type = dict) -> Any:
    """The JSON value of `path`, which must be a `kind` (an object unless told otherwise); a
    missing, empty, truncated or otherwise invalid file is refused."""
    text = read_text(path, fix, error)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise refusal(
            path,
            f"is corrupted or truncated (not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno})",
            fix,
            error,
        ) from exc
    if not isinstance(value, kind):
        raise refusal(
            path, f"is corrupted (a JSON {json_kind(value)} where a JSON {json_kind(kind())} belongs)", fix, error
        )
    return value


def parse_json_object(text: str, where: str, fix: str, error: ErrorType = InputError) -> dict:
    """The JSON object in `text` (a line of a JSONL file, a command-line value); anything else is
    refused as `error`: "WHERE: invalid JSON (...); FIX" or "WHERE: a JSON array where a JSON
    object belongs; FIX". `where` names the text: "PATH:LINE", "--metadata"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{where}: a JSON {json_kind(value)} where a JSON object belongs; {fix}")
    return value


def json_kind(value: Any) -> str:
    """The JSON name of a decoded value's kind: object, array, string, number, boolean, null."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a JSON object",
    list: "a JSON array",
}


def require_fields(
    record: dict[str, Any], fields: dict[str, type | tuple[type, ...]], path: Path, fix: str, error: ErrorType
) -> None:
    """Refuse a `record` (read from `path`) that lacks one of `fields` or holds one of another type
    (an int is not a bool here, nor a bool an int)."""
    for name, wanted in fields.items():
        if name not in record:
            raise refusal(path, f"lacks its {name!r} field", fix, error)
        value = record[name]
        types = wanted if isinstance(wanted, tuple) else (wanted,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted_text = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise refusal(path, f"is corrupted (its {name!r} is {value!r}, not {wanted_text})", fix, error)


def load_npy(path: Path, fix: str, error: ErrorType = InputError) -> np.ndarray:
    """The array of the .npy file `path` (never unpickled); a missing, empty, truncated or
    otherwise damaged file is refused."""
    import numpy as np

    check_file(path, fix, error)
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        # without the .npy header numpy takes the file for a pickle, which is never loaded
        problem = "no .npy header" if "pickle" in str(exc) else f"not a readable .npy array: {exc}"
        raise refusal(path, f"is corrupted or truncated ({problem})", fix, error) from exc
