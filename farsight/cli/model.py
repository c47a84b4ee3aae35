"""`farsight generate` and `farsight export`: sample text from a trained model, copy its files out of a run."""

from __future__ import annotations

import argparse
import logging

from farsight.cli.arguments import (
    add_dtype_argument,
    add_model_argument,
    add_retrieval_reading_arguments,
    check_at_least,
    check_number,
    load_model_and_tokenizer,
    retrieval_reading,
    text_argument,
)

logger = logging.getLogger(__name__)


def add_commands(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate", help="sample text from a trained model", description="Sample text from a trained model."
    )
    add_model_argument(generate)
    add_dtype_argument(generate)
    add_retrieval_reading_arguments(generate)
    generate.add_argument("--prompt", default="", help="text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="tokens to write (at least 0)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily (at least 0)")
    generate.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens (at least 1)")
    generate.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling (0 to 2**63 - 1)")
    generate.set_defaults(func=_generate)

    export = commands.add_parser(
        "export",
        help="copy a model out of a training run",
        description=(
            "Copy the model files of a run's newest checkpoint (or of a checkpoint directory) into a model directory, "
            "with checksums.json: a source whose files differ from its checksums.json or whose weights are not finite "
            "is refused (a source without one, from an older farsight, is exported with a warning and a new record)."
        ),
    )
    export.add_argument("source", help="training run directory or checkpoint directory")
    export.add_argument(
        "out",
        help="model directory to write: a new or empty folder, or a previous export (replaced); never the source, "
        "a run, a checkpoint or a folder holding other files",
    )
    export.add_argument(
        "--force", action="store_true", help="replace a model directory in OUT that was not written by an export"
    )
    export.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="store the weights in this dtype (default: as trained; bf16 halves an fp32 model)",
    )
    export.add_argument(
        "--card",
        action="store_true",
        help="write a model card, README.md: the stages of training along train.init_from, from a run",
    )
    export.add_argument(
        "--results",
        nargs="+",
        default=[],
        metavar="JSON",
        help="with --card: results files (`farsight eval ... --out`) to tabulate, and answers files (`farsight eval harness --samples`, .jsonl) to quote",
    )
    export.add_argument(
        "--sample",
        action="append",
        default=[],
        metavar="PROMPT",
        help="with --card: show what the exported model writes after PROMPT (`farsight generate` defaults, seed 0; repeatable)",
    )
    export.set_defaults(func=_export)


def _generate(args: argparse.Namespace) -> int:
    from farsight.models.generation import continue_text

    check_at_least(args, {"--max-new-tokens": 0, "--top-k": 1, "--seed": 0})
    check_number(args, "--temperature", 0)
    check_number(args, "--top-p", 0, 1, open_low=True)
    args.prompt = text_argument(args.prompt, "--prompt")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, **retrieval_reading(args))
    text = continue_text(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed
    )
    print(args.prompt + text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from farsight.errors import InputError
    from farsight.models import export_model
    from farsight.models.registry import check_export_target

    if (args.results or args.sample) and not args.card:
        raise InputError(f"{'--results' if args.results else '--sample'} goes into the model card; add --card")
    out = Path(args.out)
    check_export_target(args.source, out, args.force)  # before the card reads the training chain
    args.sample = [text_argument(prompt, "--sample") for prompt in args.sample]
    readme = None
    if args.card:
        from farsight.eval.card import model_card

        # reads the training chain and the results now; export_model hands it the exported model
        readme = model_card(args.source, out.resolve().name, args.results, args.sample, args.dtype, exported_to=out)
    source = export_model(args.source, out, args.dtype, readme, overwrite=args.force)
    logger.info(
        f"exported {source} -> {out}"
        + (f" (weights in {args.dtype})" if args.dtype else "")
        + (", with README.md" if readme else "")
    )
    return 0
