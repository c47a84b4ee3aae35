"""`farsight eval bench`: run the benchmark scripts of a source checkout and collect their figures."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from farsight.errors import InputError, MissingFileError
from farsight.eval.efficiency import write_json

logger = logging.getLogger(__name__)

BENCHMARKS = ("train_throughput", "castle", "drt", "retrieval", "buffers", "kernels")


def benchmarks_dir() -> Path:
    directory = Path(__file__).resolve().parents[2] / "benchmarks"
    if not directory.is_dir():
        raise MissingFileError(f"{directory} not found: the benchmarks ship with the source checkout, run from a clone")
    return directory


def run_benchmarks(names: list[str] | None = None, quick: bool = False, json_path: str | None = None) -> int:
    """Run each benchmark script in its own process (its output streams through); 0 if all succeed."""
    names = list(names or BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise InputError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    directory = benchmarks_dir()
    collected, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            logger.info(f"=== {name} ===")
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(directory / f"{name}.py"), "--json", str(out)] + (["--quick"] if quick else [])
            code = subprocess.call(cmd)
            if code != 0:
                failed.append(name)
            if out.is_file():
                collected[name] = json.loads(out.read_text())
    write_json(json_path, collected)
    if failed:
        logger.error(f"failed: {', '.join(failed)}")
    return 1 if failed else 0
