"""`farsight` command line: data preparation, training, generation, evaluation, benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from farsight.cli import data, demo, evaluation, model, train
from farsight.errors import FarsightError
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a farsight error (a problem the user can fix) prints `error: ...` and returns 2."""
    args = build_parser().parse_args(argv)
    tune_malloc()  # the command owns the process (FARSIGHT_DEFAULT_MALLOC=1 leaves glibc's defaults)
    try:
        return args.func(args)
    except FarsightError as exc:
        if args.traceback:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
