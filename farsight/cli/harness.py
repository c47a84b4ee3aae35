"""`farsight eval harness`: lm-evaluation-harness tasks on a farsight model, through its streaming Session."""

from __future__ import annotations

import argparse

from farsight.cli.arguments import (
    add_dtype_argument,
    add_json_output_argument,
    add_memory_argument,
    add_model_argument,
    add_retrieval_reading_arguments,
    check_at_least,
    check_memory_tier,
    check_output_file,
    measured_on,
    parse_list,
    retrieval_reading,
)
from farsight.errors import InputError, MissingDependencyError, MissingFileError
from farsight.readers import parse_json_object


def add_harness_command(evaluations: argparse._SubParsersAction) -> None:
    harness = evaluations.add_parser(
        "harness",
        help="lm-evaluation-harness tasks",
        description="Run lm-evaluation-harness tasks (lm_eval.simple_evaluate) on a farsight model and print lm-eval's table. "
        "Needs `pip install farsight[eval,hf]`. Task YAML files can run Python code (`!function`): "
        "--include-path only folders you trust.",
    )
    add_model_argument(harness)
    harness.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    harness.add_argument(
        "--include-path",
        help="folder of extra task YAML files. Caution: lm-eval runs the Python code a YAML there names with "
        "`!function` (e.g. utils.py beside it, as in farsight's own exports); pass only folders you trust",
    )
    harness.add_argument(
        "--limit", type=float, default=None, help="examples per task (a fraction if below 1), for quick checks"
    )
    harness.add_argument(
        "--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: each task's)"
    )
    harness.add_argument("--batch-size", type=int, default=1, help="requests of equal token lengths decoded together")
    harness.add_argument(
        "--align-context",
        action="store_true",
        help="DRT: score log-likelihoods with each context aligned to end on a chunk boundary, as a session "
        "prefill aligns a prompt (for tasks exported with --align 1; default: the stream from the context's "
        "first token, as lm-eval's hf model scores it)",
    )
    harness.add_argument(
        "--metadata",
        help="JSON object passed to the tasks, as lm_eval's --metadata: e.g. '{\"max_seq_lengths\": [4096, 16384]}' "
        "for lm-eval's RULER tasks (they build their items with the model's own tokenizer unless it names "
        '"tokenizer")',
    )
    add_memory_argument(harness)
    add_dtype_argument(harness)
    add_retrieval_reading_arguments(harness)
    harness.set_defaults(widen_cpu_matmuls=False)  # FarsightLM widens them itself, on the device it picks
    add_json_output_argument(harness)
    harness.add_argument(
        "--samples",
        help="write each item's target, the model's answer and its scores as JSON lines (lm-eval's logged "
        "samples without the prompts, which RULER makes up to millions of characters long)",
    )
    harness.set_defaults(func=_harness)


def _harness(args: argparse.Namespace) -> int:
    import math
    from pathlib import Path

    check_output_file(args.out, "--out")
    check_output_file(args.samples, "--samples")
    check_at_least(args, {"--batch-size": 1, "--num-fewshot": 0})
    check_memory_tier(args.model, args.memory, args.kv_dtype)
    if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0):
        raise InputError(f"--limit must be > 0, got {args.limit}")
    if args.limit is not None and args.limit >= 1 and args.limit != int(args.limit):
        raise InputError(
            f"--limit {args.limit}: a count of examples is a whole number (below 1, a fraction), got {args.limit}"
        )
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise MissingFileError(
            f"--include-path {args.include_path} is not a folder; pass the folder holding the task YAML files"
        )
    tasks = parse_list(args.tasks, str.strip, "--tasks", "task names")
    metadata = _parse_metadata(args.metadata)
    try:
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError as exc:
        raise MissingDependencyError(
            f"farsight eval harness needs lm-eval ({exc}); run: pip install farsight[eval]"
        ) from None
    from farsight.eval.efficiency import write_json, write_json_lines
    from farsight.hf.harness import evaluate, sample_records  # MissingDependencyError without transformers

    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    # the weights loaded now; --out and --samples record the same
    measured = measured_on(args.model, **retrieval_reading(args))
    results = evaluate(
        args.model,
        tasks,
        include_path=args.include_path,
        limit=limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        memory=args.memory,
        kv_dtype=args.kv_dtype,
        dtype=args.dtype,
        align_context=args.align_context,
        metadata=metadata,
        log_samples=args.samples is not None,
        **retrieval_reading(args),
    )
    samples = results.pop("samples", None)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    # which model and dtype, as farsight's own evaluations record them (a model card checks the model)
    write_json(args.out, {**results, **measured, "dtype": args.dtype}, default=handle_non_serializable)
    if args.samples is not None:
        # on every line, so that a model card can tell whose answers they are
        records = ({**record, **measured} for record in sample_records(samples or {}))
        write_json_lines(args.samples, records, default=handle_non_serializable)
    return 0


def _parse_metadata(text: str | None) -> dict | None:
    """--metadata: a JSON object, or None when not given."""
    if text is None:
        return None
    return parse_json_object(text, "--metadata", """pass an object, e.g. '{"max_seq_lengths": [4096]}'""")
