"""The training log: reading a run's metrics.jsonl (one JSON record per logged step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farsight.errors import InputError


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (a run killed mid-write) is skipped; a bad
    line anywhere else is an error, since it means the file is not a farsight training log."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); is it a farsight metrics.jsonl?"
        ) from exc
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
