"""`farsight eval ruler`: RULER-style tasks (NIAH variants, variable tracking, common and frequent
words) through the needle evaluation, or written out as lm-eval tasks with --export."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from farsight.cli.arguments import (
    EVALUATION_ONLY,
    add_dtype_argument,
    add_force_argument,
    add_json_output_argument,
    add_memory_argument,
    add_model_argument,
    add_needle_grid_arguments,
    add_retrieval_reading_arguments,
    check_at_least,
    check_memory_for,
    check_output_file,
    check_output_folder,
    check_plot_file,
    claim_output,
    load_model_and_tokenizer,
    measured_on,
    model_chunk_size,
    model_tokenizer,
    needle_grid,
    parse_task_options,
    refuse_unused,
    retrieval_reading,
)
from farsight.errors import InputError

logger = logging.getLogger(__name__)


def add_ruler_command(evaluations: argparse._SubParsersAction) -> None:
    """Add `ruler` to the `farsight eval` commands."""
    ruler = evaluations.add_parser(
        "ruler",
        help="RULER-style tasks: NIAH variants, variable tracking, common/frequent words",
        description="RULER-style long-context tasks generated offline, scored by string match (the fraction of reference "
        "answers in the greedy output) and exact match over lengths x depths. With --export, write them as lm-eval tasks instead.",
    )
    add_model_argument(ruler, default="")
    ruler.add_argument(
        "--tasks", default="all", help="comma-separated RULER tasks (niah_single_1, ..., vt, cwe, fwe), or all"
    )
    add_needle_grid_arguments(ruler, lengths="1k,4k", trials=10, long_trials=None)
    ruler.add_argument(
        "--haystack",
        choices=["noise", "corpus"],
        default=None,
        help="filler text of every task (default: RULER's per task, real text for most NIAH tasks)",
    )
    ruler.add_argument(
        "--corpus", default=None, help="prepared dataset for real-text haystacks (farsight data prepare)"
    )
    ruler.add_argument("--split", default="val", help="split of --corpus used as haystack (default: held-out val)")
    ruler.add_argument(
        "--align",
        type=int,
        default=None,
        help="the question ends on a multiple of this (default: the model's chunk size; 1 with --export; "
        "below the chunk size each trial's question sits at its own offset, unpadded)",
    )
    ruler.add_argument("--batch-size", type=int, default=1, help="trials decoded together")
    add_memory_argument(ruler)
    add_dtype_argument(ruler)
    add_retrieval_reading_arguments(ruler)
    ruler.add_argument("--seed", type=int, default=0)
    ruler.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of every task asked, e.g. keys=8",
    )
    add_json_output_argument(ruler)
    ruler.add_argument("--plot", help="write length x depth heatmaps (PNG; one per task, named after it when several)")
    ruler.add_argument(
        "--export", metavar="DIR", help="write the items and lm-eval task YAMLs to DIR instead of evaluating"
    )
    ruler.add_argument("--tokenizer", help="with --export: byte, gpt2 or a tokenizer.json path (default: --model's)")
    add_force_argument(ruler, "the tasks", "--export")
    ruler.set_defaults(func=_ruler)


def _ruler(args: argparse.Namespace) -> int:
    from farsight.data.tasks.ruler import make_ruler_tasks, ruler_task_names

    check_output_file(args.out, "--out")
    check_plot_file(args.plot)
    check_at_least(args, {"--batch-size": 1, "--align": 1, "--seed": 0})
    if args.haystack == "noise":
        refuse_unused(args, {"--corpus": None, "--split": "val"}, "with --haystack noise (no real-text haystack)")
    if args.export:
        refuse_unused(
            args,
            EVALUATION_ONLY,
            "with --export, which writes lm-eval tasks instead of evaluating",
        )
    lengths, depths, trials = needle_grid(args)
    check_memory_for(args, lengths, trials)
    names = ruler_task_names(args.tasks)
    options = parse_task_options(args.task_option)
    if args.export:
        return _export(args, names, options, lengths, depths, trials)
    if not args.model:
        raise InputError("--model is required to evaluate (or pass --export DIR to write lm-eval tasks)")
    if args.tokenizer:
        raise InputError("--tokenizer only applies with --export; an evaluation uses the model's tokenizer")
    if args.force:
        raise InputError("--force only applies with --export; an evaluation writes no folder")
    tokenizer = model_tokenizer(args.model)
    # the tasks are checked before the model loads, so a bad option or length fails at once
    align = args.align or model_chunk_size(args.model)
    tasks = make_ruler_tasks(names, tokenizer, align, args.haystack, args.corpus, args.split, options)
    _check_lengths(tasks, lengths)
    from farsight.eval.efficiency import write_json
    from farsight.eval.ruler import average_table, evaluate_ruler, ruler_table

    # the weights loaded now, whatever the run saves while this runs
    measured = measured_on(args.model, **retrieval_reading(args))
    model, _ = load_model_and_tokenizer(args.model, args.dtype, **retrieval_reading(args))
    results = evaluate_ruler(
        model,
        tasks,
        lengths,
        depths,
        trials,
        seed=args.seed,
        batch_size=args.batch_size,
        memory=args.memory,
        kv_dtype=args.kv_dtype,
    )
    for name, summary in results["tasks"].items():
        print(f"\n{name} ({summary['haystack']} haystack)")
        print(ruler_table(summary))
    print("\nstring match % (RULER's score)")
    print(average_table(results))
    results.update(
        **measured,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        align=align,
        corpus=args.corpus,
        split=args.split,
        seed=args.seed,
    )
    write_json(args.out, results)
    if args.plot:
        from farsight.eval.plots import needle_heatmap

        for name, summary in results["tasks"].items():
            path = Path(args.plot)
            if len(results["tasks"]) > 1:
                path = path.with_name(f"{path.stem}-{name}{path.suffix}")
            logger.info(
                f"wrote {needle_heatmap(summary, path, title=f'{name}: string match, {args.model}', metric='string_match')}"
            )
    return 0


def _check_lengths(tasks: list, lengths: list[int]) -> None:
    """Fail before any model work when a task cannot fit the shortest length (its error names the fix)."""
    import numpy as np

    for task in tasks:
        task.sample(min(lengths), 0.5, np.random.default_rng(0))


def _export(
    args: argparse.Namespace,
    names: list[str],
    options: dict[str, object],
    lengths: list[int],
    depths: list[float],
    trials: dict[int, int],
) -> int:
    from farsight.data.tasks.ruler import make_ruler_tasks
    from farsight.data.tokenizers import load_tokenizer
    from farsight.eval.ruler import export_lm_eval

    check_output_folder(args.export, "--export")
    claim_output(args.export, "tasks", args.force, "--export")
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    elif args.model:
        tokenizer = model_tokenizer(args.model)
    else:
        raise InputError(
            "--export needs the tokenizer the lengths are measured in: pass --tokenizer (byte, gpt2, a path) or --model"
        )
    tasks = make_ruler_tasks(names, tokenizer, args.align or 1, args.haystack, args.corpus, args.split, options)
    _check_lengths(tasks, lengths)
    written = export_lm_eval(tasks, lengths, depths, trials, args.export, seed=args.seed, overwrite=args.force)
    logger.info(f"wrote {len(written)} lm-eval tasks to {args.export}: {', '.join(written)}")
    logger.info(
        f"run them with lm_eval --include_path {args.export} --tasks {written[0]} (or the tag farsight_ruler for all)"
    )
    return 0
