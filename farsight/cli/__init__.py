"""`farsight` command line: data preparation, training, generation, evaluation, benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from farsight.cli import data, demo, evaluation, model, train
from farsight.cli.arguments import output_files_named
from farsight.errors import FarsightError
from farsight.files import WRITE_FAILURES, write_failure
from farsight.process_memory import tune_malloc
from farsight.progress import close_progress_bars, show_progress_bars

# each adds its commands to the parser, in this order in `farsight --help`
COMMAND_GROUPS = (data, train, model, demo, evaluation)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors in one line, as farsight's own errors are (the
    usage block is what --help is for), naming the closest valid choice or option to a typo.
    Subcommand parsers are of the same class (add_subparsers makes its parent's)."""

    innermost: _Parser | None = None  # the deepest (sub)command parser of the current parse

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        _Parser.innermost = self  # a subcommand's parser is called inside its parent's
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        # the root parser reports the arguments no subcommand took: name the subcommand's options
        parser = _Parser.innermost if message.startswith("unrecognized") and _Parser.innermost else self
        parser.exit(2, f"error: {message}{parser._suggestion(message)}; see `{parser.prog} --help`\n")

    def _suggestion(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice is not None:
            typo, candidates = choice[1], re.findall(r"[\w.-]+", choice[2])
        else:
            unknown = re.search(r"unrecognized arguments: (-[-\w]+)", message)
            if unknown is None:
                return ""
            typo = unknown[1].split("=")[0]
            candidates = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(typo, candidates, n=1)
        return f" (did you mean {close[0]}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="farsight", description=__doc__)
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    _add_verbosity_arguments(parser, 0)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_commands(commands)
    for command in _subcommands(commands):
        # `farsight train -q CONFIG` as well as `farsight -q train CONFIG`; SUPPRESS keeps the
        # top-level value where the subcommand does not repeat the flag
        _add_verbosity_arguments(command, argparse.SUPPRESS)
    return parser


def _add_verbosity_arguments(parser: argparse.ArgumentParser, default: object) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        default=default,
        help="print errors only: no notes, no progress bars",
    )
    group.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=default,
        help="also print farsight's debug messages",
    )


def _subcommands(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Every parser below `commands`, nested groups (`farsight data prepare`) included."""
    found = []
    for parser in dict.fromkeys(commands.choices.values()):  # aliases map to the same parser
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found += _subcommands(action)
    return found


class _TerminalHandler(logging.Handler):
    """Writes farsight's log records to the terminal as a command's own lines: notes (INFO,
    DEBUG) to the current sys.stdout, warnings and errors to sys.stderr, through tqdm so that a
    message lands on its own line above a progress bar being drawn."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            tqdm.write(self.format(record), file=stream)
        except Exception:
            self.handleError(record)


def configure_output(verbosity: int) -> None:
    """The terminal's share of farsight's logging: -1 errors only and no progress bars, 0 notes
    and progress (the default), 1 debug messages too. Replaces what an earlier call set up."""
    logger = logging.getLogger("farsight")
    for handler in [h for h in logger.handlers if isinstance(h, _TerminalHandler)]:
        logger.removeHandler(handler)
    handler = _TerminalHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel({-1: logging.ERROR, 0: logging.INFO}.get(verbosity, logging.DEBUG))
    # the terminal handler is the command's output: a root handler that a library the command
    # imports sets up (lm-eval's, transformers') would print each record a second time
    logger.propagate = False
    show_progress_bars(verbosity >= 0)


EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command whose reader closed the pipe (128 + SIGPIPE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a farsight error (a problem the user can fix) prints `error: ...` and
    returns 2, and so does a write that fails for want of space wherever it happens; Ctrl-C prints
    `interrupted` and returns 130 (each command removes what it had half written)."""
    args = build_parser().parse_args(argv)
    configure_output(args.verbosity)
    output_files_named().clear()  # the outputs another command of this process named are not this one's
    tune_malloc()  # the command owns the process (FARSIGHT_DEFAULT_MALLOC=1 leaves glibc's defaults)
    try:
        with _model_matmuls(args):
            return args.func(args)
    except FarsightError as exc:
        if args.traceback:
            raise
        close_progress_bars()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of the output went away (`farsight data info DIR | head`): nothing to report;
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        if args.traceback or exc.errno not in WRITE_FAILURES:
            raise
        close_progress_bars()
        print(f"error: {write_failure(exc.filename or 'a file farsight was writing', exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.traceback:
            raise
        close_progress_bars()
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
