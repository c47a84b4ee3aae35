"""`farsight train CONFIG.yaml`: train a model from a YAML config (resuming the run in train.out_dir)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130


def add_commands(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a model from a YAML config", description="Train a model from a YAML config."
    )
    train.add_argument("config", help="YAML file with sections model, data, optim, train")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.steps=100"
    )
    train.add_argument(
        "--restart",
        action="store_true",
        help="start over: delete the checkpoints farsight wrote in train.out_dir/checkpoints (other files there stay)",
    )
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though optim, data, train.seed or train.grad_accum differ from the checkpoint's, with the new values",
    )
    train.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though the token files at data.path (or data.corpus) differ from those the checkpoint was trained on",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from farsight.train.config import load_train_config
    from farsight.train.trainer import GradientLost, TrainingDiverged, train

    config = load_train_config(args.config, args.set)
    if args.no_progress:
        config.train.progress = False
    try:
        result = train(
            config,
            resume=not args.restart,
            allow_config_change=args.allow_config_change,
            allow_data_change=args.allow_data_change,
        )
    except (TrainingDiverged, GradientLost) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    if result.status == "interrupted":
        return EXIT_INTERRUPTED
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        logger.info(f"done: step {result.step}, checkpoint {result.checkpoint}")
    return 0
