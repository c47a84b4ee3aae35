"""The training log: reading a run's metrics.jsonl (one JSON record per logged step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farsight.errors import InputError
from farsight.readers import read_text


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (a run killed mid-write) is skipped; a bad
    line anywhere else is an error, since it means the file is not a farsight training log."""
    records = []
    lines = read_text(path, "is it a farsight metrics.jsonl?", InputError, empty_ok=True).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise InputError(
                f"{path} line {number} is not JSON ({exc}); is it a farsight metrics.jsonl? Delete the line to go on"
            ) from exc
        if not isinstance(record, dict):
            raise InputError(
                f"{path} line {number} is not a JSON object; is it a farsight metrics.jsonl? Delete the line to go on"
            )
        records.append(record)
    return records
