"""The training log: reading a run's metrics.jsonl (one JSON record per logged step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farsight.errors import InputError
from farsight.readers import parse_json_object, read_text


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (a run killed mid-write) is skipped; a bad
    line anywhere else is an error, since it means the file is not a farsight training log."""
    records = []
    lines = read_text(path, "is it a farsight metrics.jsonl?", InputError, empty_ok=True).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(
                parse_json_object(line, f"{path}:{number}", "is it a farsight metrics.jsonl? Delete the line to go on")
            )
        except InputError:
            if number == len(lines):
                break
            raise
    return records
