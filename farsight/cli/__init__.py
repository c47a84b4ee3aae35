"""`farsight` command line: data preparation, training, generation, evaluation, benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from farsight.cli import data, demo, evaluation, model, train
from farsight.errors import FarsightError
from farsight.files import WRITE_FAILURES, write_failure
from farsight.process_memory import tune_malloc

# each adds its commands to the parser, in this order in `farsight --help`
COMMAND_GROUPS = (data, train, model, demo, evaluation)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="farsight", description=__doc__)
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_commands(commands)
    return parser


EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C (128 + SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a farsight error (a problem the user can fix) prints `error: ...` and
    returns 2, and so does a write that fails for want of space wherever it happens; Ctrl-C prints
    `interrupted` and returns 130 (each command removes what it had half written)."""
    args = build_parser().parse_args(argv)
    tune_malloc()  # the command owns the process (FARSIGHT_DEFAULT_MALLOC=1 leaves glibc's defaults)
    try:
        with _model_matmuls(args):
            return args.func(args)
    except FarsightError as exc:
        if args.traceback:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if args.traceback or exc.errno not in WRITE_FAILURES:
            raise
        print(f"error: {write_failure(exc.filename or 'a file farsight was writing', exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.traceback:
            raise
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _model_matmuls(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """Around a command that runs a model on the CPU in --dtype bf16 or fp16: the products this
    CPU has no matrix instructions for run as fp32 GEMMs (`farsight.ops.precision.widened_matmuls`)."""
    dtype = getattr(args, "dtype", None)
    if not getattr(args, "widen_cpu_matmuls", False) or dtype not in ("bf16", "fp16"):
        return contextlib.nullcontext()
    import torch

    from farsight.models import MODEL_DTYPES
    from farsight.ops.precision import widened_matmuls

    return widened_matmuls(torch.device("cpu"), MODEL_DTYPES[dtype])
