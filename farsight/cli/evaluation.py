"""`farsight eval ...`: needle tasks, perplexity vs length, generated answers, DRT retrieval, comparison tables, run summaries, benchmarks."""

from __future__ import annotations

import argparse
import logging

from farsight.cli.arguments import (
    EVALUATION_ONLY,
    add_dtype_argument,
    add_force_argument,
    add_json_output_argument,
    add_lengths_argument,
    add_memory_argument,
    add_model_argument,
    add_needle_grid_arguments,
    add_retrieval_reading_arguments,
    check_at_least,
    check_memory_for,
    check_memory_tier,
    check_output_file,
    check_output_folder,
    check_plot_file,
    claim_output,
    load_model_and_tokenizer,
    measured_on,
    model_chunk_size,
    model_tokenizer,
    needle_grid,
    open_corpus,
    parse_labels,
    parse_lengths,
    parse_list,
    parse_task_options,
    refuse_unused,
    retrieval_reading,
)
from farsight.cli.harness import add_harness_command
from farsight.cli.ruler import add_ruler_command
from farsight.errors import InputError, MissingFileError

logger = logging.getLogger(__name__)

NEEDLE_TASKS = (
    ("passkey", "single needle: 'The passkey is: {P}.'"),
    ("multikey", "several passkeys under different keys, one asked"),
    ("niah2hop", "2-hop chain a->b->c among distractor chains"),
)


def add_commands(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="long-context evaluations and benchmarks", description="Long-context evaluations and benchmarks."
    )
    evaluations = evaluate.add_subparsers(dest="eval_command", required=True, metavar="EVALUATION")
    for task, what in NEEDLE_TASKS:
        _add_needle_command(evaluations, task, what)
    add_ruler_command(evaluations)
    add_harness_command(evaluations)

    ppl = evaluations.add_parser(
        "ppl",
        help="perplexity vs evaluation length",
        description="Perplexity vs evaluation length on held-out documents.",
    )
    add_model_argument(ppl, repeatable=True)
    ppl.add_argument("--corpus", required=True, help="prepared dataset")
    ppl.add_argument("--split", default="val")
    add_lengths_argument(ppl, "1k,2k,4k,8k")
    ppl.add_argument(
        "--windows", type=int, default=8, help="disjoint windows, each scored from its start to the longest length"
    )
    ppl.add_argument(
        "--window-length",
        help="draw windows this long (default: the longest length) and score their first tokens: compares a model that "
        "cannot run as far on the same text as a longer run (e.g. 128k)",
    )
    ppl.add_argument("--batch-size", type=int, default=4)
    add_memory_argument(ppl)
    add_dtype_argument(ppl)
    ppl.add_argument("--seed", type=int, default=0)
    add_json_output_argument(ppl)
    ppl.add_argument("--plot", help="write perplexity vs length as a PNG")
    ppl.set_defaults(func=_perplexity)

    generate = evaluations.add_parser(
        "generate",
        help="generated answers to held-out prompts, scored with ROUGE and exact match",
        description="Greedy answers to the prompts of a JSONL file of supervised examples (prompt/completion or "
        "messages, as `farsight data prepare-sft` reads them), through the model's session, scored against the "
        "references with ROUGE-1/2/L (rouge-score) and exact match, overall and by prompt length.",
    )
    add_model_argument(generate)
    generate.add_argument("--data", required=True, help="a JSONL file of held-out examples")
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="the most tokens an answer may have (default 64)"
    )
    generate.add_argument(
        "--stop-at-newline", action="store_true", help="end an answer at its first newline (always at eos)"
    )
    generate.add_argument("--limit", type=int, default=None, help="evaluate the first N examples only")
    generate.add_argument(
        "--per-bucket",
        type=int,
        default=None,
        metavar="N",
        help="evaluate at most N examples of each prompt-length bucket (--buckets), spread evenly over the file",
    )
    generate.add_argument(
        "--buckets",
        help="comma-separated prompt-length bucket edges, e.g. 2k,4k,8k,16k,32k,64k (default: powers of two)",
    )
    generate.add_argument(
        "--skip-bad-records", action="store_true", help="leave out bad records (counted) instead of stopping"
    )
    add_memory_argument(generate)
    add_dtype_argument(generate)
    add_retrieval_reading_arguments(generate)
    add_json_output_argument(generate)
    generate.add_argument(
        "--show", type=int, default=3, help="print the first N answers beside their references (default 3)"
    )
    generate.set_defaults(func=_generate)

    retrieval = evaluations.add_parser(
        "retrieval",
        help="show the chunks a DRT retrieves",
        description="Show, per chunk, the past chunks a DRT retrieves with their weights and text.",
    )
    add_model_argument(retrieval)
    source = retrieval.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a text file")
    source.add_argument("--corpus", help="a prepared dataset (with --document)")
    retrieval.add_argument("--split", default="val")
    retrieval.add_argument("--document", type=int, default=0, help="document number in --split (from 0)")
    retrieval.add_argument("--chunks", help="comma-separated querying chunks to show (default: all)")
    retrieval.add_argument(
        "--top", type=int, default=None, help="show only the N chunks with the most confident retrieval"
    )
    retrieval.add_argument("--max-tokens", type=int, default=16384)
    add_retrieval_reading_arguments(retrieval)
    add_json_output_argument(retrieval)
    retrieval.set_defaults(func=_retrieval)

    compare = evaluations.add_parser(
        "compare",
        help="compare needle-task results of several models",
        description="One table (and plot) of needle-task results written by --out: a row per length, a column per model.",
    )
    compare.add_argument(
        "results", nargs="+", help="JSON files written by `farsight eval passkey|multikey|niah2hop --out`"
    )
    compare.add_argument(
        "--labels",
        help="comma-separated column names (default: the file names); files with one name are one model's lengths run in parts",
    )
    compare.add_argument("--metric", default="exact_match", choices=["exact_match", "first_token", "needle_retrieved"])
    compare.add_argument("--plot", help="write accuracy vs length as a PNG")
    compare.add_argument("--title")
    compare.set_defaults(func=_compare)

    runs = evaluations.add_parser(
        "runs",
        help="summarise training runs side by side",
        description="A table of training runs: parameters, steps, tokens, last train and held-out loss, speed and hours, "
        "read from each run's newest checkpoint and metrics.jsonl.",
    )
    runs.add_argument("run", nargs="+", help="training run directories (train.out_dir)")
    add_json_output_argument(runs)
    runs.add_argument("--plot", help="write the loss curves (train and held-out loss vs tokens) as a PNG")
    runs.add_argument(
        "--labels", help="comma-separated legend names, one per run; runs with the same name (seeds) share a colour"
    )
    runs.add_argument("--title", default="training loss")
    runs.add_argument(
        "--relative-to",
        metavar="LABEL",
        help="with --plot, add a panel of each run's held-out loss minus that of the run with this label and the same seed "
        "(the i-th of each label's runs pairs with the i-th LABEL run; a single LABEL run serves all)",
    )
    runs.set_defaults(func=_runs)

    bench = evaluations.add_parser(
        "bench",
        help="run the benchmarks and collect their figures",
        description="Run benchmarks/*.py and collect their figures.",
    )
    bench.add_argument("--only", help="comma-separated subset, e.g. castle,drt")
    bench.add_argument("--quick", action="store_true")
    add_json_output_argument(bench, flag="--json", what="all figures")
    bench.set_defaults(func=_bench)


def _add_needle_command(evaluations: argparse._SubParsersAction, task: str, what: str) -> None:
    needle = evaluations.add_parser(
        task,
        help=f"needle in a haystack: {what}",
        description=f"Needle in a haystack: {what}. "
        "Exact match of all answer tokens (greedy) and first-token accuracy over lengths x depths.",
    )
    add_model_argument(needle)
    add_needle_grid_arguments(needle, lengths="1k,4k,16k", trials=10, long_trials=None)
    needle.add_argument("--filler", choices=["corpus", "repeat"], default="corpus", help="haystack text")
    needle.add_argument("--corpus", default="data/stdlib-byte", help="prepared dataset for corpus filler")
    needle.add_argument("--split", default="val", help="split of --corpus used as filler (default: held-out val)")
    needle.add_argument(
        "--align",
        type=int,
        default=None,
        help="the question ends on a multiple of this (default: the model's chunk size, where the session pads it to a chunk boundary; "
        "below the chunk size each trial's question sits at its own offset, unpadded)",
    )
    needle.add_argument(
        "--needle-jitter",
        type=int,
        default=0,
        metavar="TOKENS",
        help="move each trial's needle by its own shift of 0 to TOKENS-1 tokens (earlier beyond depth 0.5), so that "
        "the trials of a cell hold it at TOKENS different offsets, e.g. the model's chunk size (default 0: the depth "
        "alone places it, at one offset within a chunk for every trial of a cell)",
    )
    needle.add_argument("--batch-size", type=int, default=1, help="trials decoded together")
    add_memory_argument(needle)
    add_dtype_argument(needle)
    add_retrieval_reading_arguments(needle)
    needle.add_argument("--seed", type=int, default=0)
    needle.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. digits=7")
    add_json_output_argument(needle)
    needle.add_argument("--plot", help="write the length x depth heatmap PNG")
    needle.add_argument(
        "--export-choice",
        metavar="DIR",
        help="write the grid's items as lm-eval multiple-choice tasks to DIR instead of evaluating",
    )
    needle.add_argument(
        "--choices",
        type=int,
        default=None,
        help="with --export-choice: choices per item (the answer and random distractors; default 4, at least 2)",
    )
    add_force_argument(needle, "the tasks", "--export-choice")
    needle.set_defaults(func=_needle, task=task)


def _needle(args: argparse.Namespace) -> int:
    from farsight.data.tasks import make_filler, make_task
    from farsight.eval.efficiency import write_json
    from farsight.eval.needle import evaluate_needle_task, results_table

    check_output_file(args.out, "--out")
    check_plot_file(args.plot)
    check_at_least(args, {"--batch-size": 1, "--align": 1, "--seed": 0, "--needle-jitter": 0})
    if args.choices is not None and not args.export_choice:
        raise InputError(
            f"--choices {args.choices} sets the choices per item of --export-choice; add --export-choice DIR or drop --choices"
        )
    if args.force and not args.export_choice:
        raise InputError(
            "--force lets --export-choice write into a folder that holds something else; add --export-choice DIR or drop --force"
        )
    if args.filler == "repeat":
        refuse_unused(args, {"--corpus": "data/stdlib-byte", "--split": "val"}, "with --filler repeat (no corpus text)")
    if args.export_choice:
        refuse_unused(
            args,
            EVALUATION_ONLY,
            "with --export-choice, which writes lm-eval tasks instead of evaluating",
        )
    lengths, depths, trials = needle_grid(args)
    check_memory_for(args, lengths, trials)
    options = parse_task_options(args.task_option)
    if args.export_choice:
        return _export_choice(args, lengths, depths, trials, options)
    # the weights loaded now, whatever the run saves while this runs
    measured = measured_on(args.model, **retrieval_reading(args))
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, **retrieval_reading(args))
    align = args.align or getattr(model.config, "chunk_size", 1)
    filler = make_filler(args.filler, tokenizer, args.corpus, args.split)
    task = make_task(args.task, tokenizer, filler, align, **options)
    summary = evaluate_needle_task(
        model,
        task,
        lengths,
        depths,
        trials,
        seed=args.seed,
        batch_size=args.batch_size,
        memory=args.memory,
        kv_dtype=args.kv_dtype,
        needle_jitter=args.needle_jitter,
    )
    summary.update(
        **measured,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        align=align,
        filler=args.filler,
        corpus=args.corpus,
        split=args.split,
        seed=args.seed,
        task_options=options,
    )
    print(results_table(summary))
    write_json(args.out, summary)
    if args.plot:
        from farsight.eval.plots import needle_heatmap

        logger.info(f"wrote {needle_heatmap(summary, args.plot, title=f'{args.task}: {args.model}')}")
    return 0


def _export_choice(
    args: argparse.Namespace, lengths: list[int], depths: list[float], trials: dict[int, int], options: dict
) -> int:
    from farsight.data.tasks import make_filler, make_task
    from farsight.eval.choice import export_choice_tasks

    check_output_folder(args.export_choice, "--export-choice")
    claim_output(args.export_choice, "tasks", args.force, "--export-choice")
    args.choices = 4 if args.choices is None else args.choices
    check_at_least(args, {"--choices": 2})
    tokenizer = model_tokenizer(args.model)
    align = args.align or model_chunk_size(args.model)
    task = make_task(
        args.task, tokenizer, make_filler(args.filler, tokenizer, args.corpus, args.split), align, **options
    )
    names = export_choice_tasks(
        task,
        lengths,
        depths,
        trials,
        args.export_choice,
        choices=args.choices,
        seed=args.seed,
        overwrite=args.force,
        needle_jitter=args.needle_jitter,
    )
    logger.info(f"wrote {len(names)} lm-eval tasks to {args.export_choice}: {', '.join(names)}")
    # a question at any offset of its chunk is scored as `eval passkey` decodes it with the
    # context aligned to end on a chunk boundary
    aligned = " --align-context" if align < model_chunk_size(args.model) else ""
    logger.info(
        f"run them with: farsight eval harness --model {args.model} --include-path {args.export_choice} "
        f"--tasks {','.join(names)}{aligned}"
    )
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from farsight.eval.efficiency import format_table, write_json
    from farsight.eval.needle import format_length, parse_length
    from farsight.eval.perplexity import MIN_LENGTH, evaluate_perplexity

    check_output_file(args.out, "--out")
    check_plot_file(args.plot)
    check_at_least(args, {"--windows": 1, "--batch-size": 1, "--seed": 0})
    lengths = parse_lengths(args, minimum=MIN_LENGTH)
    if args.window_length is not None:
        try:
            args.window_length = parse_length(args.window_length)
        except ValueError as exc:
            raise InputError(f"--window-length {args.window_length!r} is not a length such as 128k: {exc}") from exc
    for path in args.model:
        check_memory_tier(path, args.memory, args.kv_dtype)
    split = open_corpus(args.corpus, args.split, args.model)
    results, series = {}, {}
    for path in args.model:
        weights = measured_on(path)["trained_weights"]  # the weights loaded now
        model, _ = load_model_and_tokenizer(path, args.dtype)
        out = evaluate_perplexity(
            model,
            split,
            lengths,
            args.windows,
            args.batch_size,
            args.seed,
            memory=args.memory,
            kv_dtype=args.kv_dtype,
            window_length=args.window_length,
        )
        results[path] = {**out, "trained_weights": weights}
        series[path] = {int(k): v["ppl"] for k, v in out["by_length"].items()}
    rows = [
        {"length": format_length(n), **{p: _ppl_cell(results[p]["by_length"][str(n)]) for p in args.model}}
        for n in lengths
    ]
    print(format_table(rows, ["length", *args.model]))
    first = next(iter(results.values()))
    print(
        f"perplexity (mean NLL nats ± its standard error) over the first L tokens of the same {args.windows} disjoint "
        f"{format_length(first['window_length'])}-token windows (from {first['source']})"
    )
    if len(args.model) > 1:
        print(f"\nNLL minus {args.model[0]}'s on the same windows (paired mean ± standard error, nats):")
        print(format_table(_paired_rows(results, args.model, lengths), ["length", "tokens", *args.model[1:]]))
    write_json(
        args.out,
        {
            "corpus": args.corpus,
            "split": args.split,
            "seed": args.seed,
            "dtype": args.dtype,
            "kv_dtype": args.kv_dtype,
            "results": results,
        },
    )
    if args.plot:
        from farsight.eval.plots import curves

        logger.info(f"wrote {curves(series, args.plot, 'perplexity', f'perplexity vs length ({args.corpus})')}")
    return 0


def _paired_rows(results: dict, models: list[str], lengths: list[int]) -> list[dict]:
    """Per length, two rows: the first L tokens and the tokens since the next shorter length."""
    from farsight.eval.needle import format_length
    from farsight.eval.perplexity import format_error, paired_difference

    rows = []
    for n in lengths:
        base = results[models[0]]["by_length"][str(n)]
        for key, tokens in (
            ("window_nll", "first L"),
            ("window_bucket_nll", f"{format_length(base['bucket_start'])}-L"),
        ):
            cells = {}
            for path in models[1:]:
                mean, sem = paired_difference(results[path]["by_length"][str(n)][key], base[key])
                cells[path] = f"{mean:+.4f} ± {format_error(sem)}"
            rows.append({"length": format_length(n), "tokens": tokens, **cells})
    return rows


def _ppl_cell(row: dict) -> str:
    from farsight.eval.perplexity import format_error

    return f"{row['ppl']:.4g} ({row['nll']:.4f} ± {format_error(row['nll_sem'])})"


def _generate(args: argparse.Namespace) -> int:
    from farsight.data.sft import SkippedRecords, check_jsonl_file, read_examples
    from farsight.eval.answers import answers_table, evaluate_answers, rouge_scorer
    from farsight.eval.efficiency import write_json
    from farsight.eval.needle import parse_length

    check_output_file(args.out, "--out")
    check_memory_tier(args.model, args.memory, args.kv_dtype)
    check_at_least(args, {"--max-new-tokens": 1, "--limit": 1, "--per-bucket": 1, "--show": 0})
    if args.limit is not None and args.per_bucket is not None:
        raise InputError("--limit takes the first examples and --per-bucket spreads over the file; pass one of the two")
    buckets = parse_list(args.buckets, parse_length, "--buckets", "lengths") if args.buckets else None
    check_jsonl_file(args.data)
    rouge_scorer()  # a missing package is reported before the model loads
    skipped = SkippedRecords() if args.skip_bad_records else None
    examples = []
    for example in read_examples(args.data, skipped):
        if args.limit is not None and len(examples) >= args.limit:
            break
        examples.append(example)
    if skipped is not None and skipped.total:
        logger.warning(f"note: {skipped.summary()}")
    if not examples:
        raise InputError(
            f"{args.data} holds no usable example; pass a JSONL file of prompt/completion or messages records"
        )
    measured = measured_on(args.model, **retrieval_reading(args))  # the weights loaded now
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, **retrieval_reading(args))
    summary = evaluate_answers(
        model,
        tokenizer,
        examples,
        max_new_tokens=args.max_new_tokens,
        stop_at_newline=args.stop_at_newline,
        memory=args.memory,
        kv_dtype=args.kv_dtype,
        buckets=buckets,
        per_bucket=args.per_bucket,
    )
    for answer in summary["answers"][: args.show]:
        print(f"{answer['where']} ({answer['prompt_tokens']:,} prompt tokens, stopped at {answer['stop']})")
        print(f"  reference: {answer['reference']!r}")
        print(f"  answer:    {answer['prediction']!r}")
    print(answers_table(summary))
    summary = {
        **measured,
        "data": str(args.data),
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "memory": args.memory,
        "max_new_tokens": args.max_new_tokens,
        "stop_at_newline": args.stop_at_newline,
        "per_bucket": args.per_bucket,
        "skipped": dict(skipped.counts) if skipped is not None else {},
        **summary,
    }
    write_json(args.out, summary)
    return 0


def _retrieval(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from farsight.eval.efficiency import write_json
    from farsight.eval.retrieval import format_retrieval, inspect_retrieval

    check_output_file(args.out, "--out")
    check_at_least(args, {"--max-tokens": 1, "--top": 1, "--document": 0})
    reading = retrieval_reading(args)
    chunks = parse_list(args.chunks, int, "--chunks", "chunk numbers") if args.chunks else None
    tokenizer = model_tokenizer(args.model)
    if args.text is not None:
        if not args.text.strip():
            raise InputError("--text is empty; pass a text file")
        refuse_unused(args, {"--split": "val", "--document": 0}, "with --text (they pick a document of --corpus)")
        if not Path(args.text).is_file():
            what = (
                "is a folder"
                if Path(args.text).is_dir()
                else "is not a regular file"
                if Path(args.text).exists()
                else "does not exist"
            )
            raise MissingFileError(f"--text {args.text} {what}; pass a text file")
        from farsight.data.corpora import invalid_utf8_note, read_text_file

        text, invalid = read_text_file(Path(args.text))
        if invalid:
            logger.warning(f"note: {invalid_utf8_note(args.text, invalid)}")
        ids = tokenizer.encode(text)
    else:
        data = open_corpus(args.corpus, args.split, [args.model])
        if args.document >= data.num_documents:
            raise InputError(
                f"--document {args.document} does not exist: the {args.split} split of {args.corpus} has documents 0..{data.num_documents - 1}"
            )
        ids = [i for i in data.document(args.document).tolist() if i not in (tokenizer.eos_id, tokenizer.bos_id)]
    chunk = model_chunk_size(args.model)
    if min(len(ids), args.max_tokens) < 2 * chunk:
        where = f"--text {args.text}" if args.text else f"document {args.document} of {args.corpus}"
        held = f"holds {len(ids)} tokens" if len(ids) < 2 * chunk else f"is cut to --max-tokens {args.max_tokens}"
        raise InputError(
            f"{where} {held}; a chunk retrieves only the chunks before it, so this model "
            f"(chunks of {chunk} tokens) needs at least {2 * chunk}: pass a longer text"
        )
    if len(ids) > args.max_tokens:
        logger.warning(f"(using the first {args.max_tokens} of {len(ids)} tokens; raise --max-tokens for more)")
        ids = ids[: args.max_tokens]
    ids = torch.tensor(ids, dtype=torch.long)
    measured = measured_on(args.model, **reading)
    model, _ = load_model_and_tokenizer(args.model, **reading)
    records = inspect_retrieval(model, ids, chunks)
    if args.top and chunks is None:
        records = sorted(records, key=lambda r: -max((i["weight"] for g in r["groups"] for i in g), default=0))[
            : args.top
        ]
        records.sort(key=lambda r: r["chunk"])
    if records:
        print(format_retrieval(records, ids, tokenizer, model.config.chunk_size))
    else:
        print(f"no chunk of the {len(ids)} tokens retrieved a past chunk")
    write_json(args.out, {**measured, "records": records})
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from farsight.eval.needle import check_needle_summary, compare_summaries
    from farsight.readers import read_json

    check_plot_file(args.plot)
    labels = parse_labels(args.labels, args.results, "result files", lambda path: path.stem, unique=False)
    summaries = []
    for label, path in zip(labels, args.results):
        if Path(path).is_dir():
            raise MissingFileError(
                f"{path} is a folder; pass result files written by `farsight eval passkey ... --out FILE` (e.g. {path}/*.json)"
            )
        if not Path(path).is_file():
            raise MissingFileError(f"{path} does not exist; write it with `farsight eval passkey ... --out {path}`")
        summary = read_json(Path(path), "pass a file written by `farsight eval passkey ... --out`", kind=object)
        check_needle_summary(summary, path)
        summaries.append((label, summary))
    table, series = compare_summaries(summaries, args.metric)
    print(f"{args.metric.replace('_', ' ')} %")
    print(table)
    if args.plot:
        from farsight.eval.plots import curves

        title = args.title or f"{summaries[0][1].get('task', 'needle')}: {args.metric.replace('_', ' ')}"
        logger.info(f"wrote {curves(series, args.plot, args.metric.replace('_', ' ') + ' %', title)}")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from farsight.eval.efficiency import write_json
    from farsight.eval.runs import runs_table, summarize_run

    check_output_file(args.out, "--out")
    check_plot_file(args.plot)
    labels = parse_labels(args.labels, args.run, "run directories", lambda path: path.resolve().name, unique=False)
    if args.relative_to is not None and not args.plot:
        raise InputError(
            f"--relative-to needs --plot (the gaps are drawn, not printed), got --relative-to {args.relative_to!r} alone"
        )
    rows = [summarize_run(run) for run in args.run]
    if args.plot:  # first: a bad --relative-to label fails before anything is printed or written
        from farsight.eval.plots import loss_curves
        from farsight.train.metrics import read_metrics

        curves = [(label, read_metrics(Path(run) / "metrics.jsonl")) for label, run in zip(labels, args.run)]
        logger.info(f"wrote {loss_curves(curves, args.plot, args.title, relative_to=args.relative_to)}")
    print(runs_table(rows))
    write_json(args.out, {"runs": rows})
    return 0


def _bench(args: argparse.Namespace) -> int:
    from farsight.eval.bench import run_benchmarks

    check_output_file(args.json, "--json")
    return run_benchmarks(args.only.split(",") if args.only else None, quick=args.quick, json_path=args.json)
