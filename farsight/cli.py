"""`farsight` command line: data preparation, training, generation, evaluation, benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from farsight.data.token_files import prepare_corpus
    from farsight.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    meta = prepare_corpus(args.source, tokenizer, args.out, val_fraction=args.val_fraction, seed=args.seed)
    print(f"wrote {args.out}: " + ", ".join(f"{s} {meta['splits'][s]['tokens']:,} tokens" for s in meta["splits"]))
    return 0


def _cmd_data_info(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    meta_path = Path(args.path) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found; run `farsight data prepare` first")
    print(json.dumps(json.loads(meta_path.read_text()), indent=2))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from farsight.train.config import load_train_config
    from farsight.train.trainer import TrainingDiverged, train

    config = load_train_config(args.config, args.set)
    if args.no_progress:
        config.train.progress = False
    try:
        result = train(config, resume=not args.restart)
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if result.status == "interrupted":
        return 130
    print(f"done: step {result.step}, checkpoint {result.checkpoint}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from farsight.data.tokenizers import load_tokenizer
    from farsight.models.lm import load_model, resolve_model_dir

    path = resolve_model_dir(args.model)
    model = load_model(path).eval()
    tokenizer = load_tokenizer(path)
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.bos_id]])
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_id,
        generator=generator,
    )
    print(args.prompt + tokenizer.decode(out[0, ids.shape[1] :].tolist()))
    return 0


def _load(path: str):
    from farsight.data.tokenizers import load_tokenizer
    from farsight.models.lm import load_model, resolve_model_dir

    directory = resolve_model_dir(path)
    return load_model(directory).eval(), load_tokenizer(directory)


def _cmd_eval_needle(args: argparse.Namespace) -> int:
    import yaml

    from farsight.data.tasks import make_filler, make_task
    from farsight.eval.efficiency import write_json
    from farsight.eval.needle import evaluate_needle_task, parse_length, results_table, trials_per_length

    model, tokenizer = _load(args.model)
    align = args.align or getattr(model.config, "chunk_size", 1)
    filler = make_filler(args.filler, tokenizer, args.corpus, args.split)
    options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.task_option)}
    task = make_task(args.task, tokenizer, filler, align, **options)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    trials = trials_per_length(lengths, args.trials, args.long_trials)
    summary = evaluate_needle_task(
        model, task, lengths, depths, trials, seed=args.seed, batch_size=args.batch_size, memory=args.memory
    )
    summary.update(model=str(args.model), align=align, filler=args.filler, corpus=args.corpus, split=args.split)
    print(results_table(summary))
    write_json(args.out, summary)
    if args.plot:
        from farsight.eval.plots import needle_heatmap

        print(f"wrote {needle_heatmap(summary, args.plot, title=f'{args.task}: {args.model}')}")
    return 0


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from farsight.data.token_files import load_token_dataset
    from farsight.eval.efficiency import format_table, write_json
    from farsight.eval.needle import format_length, parse_length
    from farsight.eval.perplexity import evaluate_perplexity

    split = load_token_dataset(args.corpus, args.split)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    results, series = {}, {}
    for path in args.model:
        model, _ = _load(path)
        out = evaluate_perplexity(model, split, lengths, args.windows, args.batch_size, args.seed, memory=args.memory)
        results[path] = out
        series[path] = {int(k): v["ppl"] for k, v in out["by_length"].items()}
    rows = [{"length": format_length(n), **{p: series[p][n] for p in args.model}} for n in lengths]
    print(format_table(rows, ["length", *args.model]))
    write_json(args.out, {"corpus": args.corpus, "split": args.split, "results": results})
    if args.plot:
        from farsight.eval.plots import curves

        print(f"wrote {curves(series, args.plot, 'perplexity', f'perplexity vs length ({args.corpus})')}")
    return 0


def _cmd_eval_retrieval(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from farsight.eval.efficiency import write_json
    from farsight.eval.retrieval import format_retrieval, inspect_retrieval

    model, tokenizer = _load(args.model)
    if args.text:
        ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))
    else:
        from farsight.data.token_files import load_token_dataset

        ids = load_token_dataset(args.corpus, args.split).document(args.document).tolist()
        ids = [i for i in ids if i not in (tokenizer.eos_id, tokenizer.bos_id)]
    if len(ids) > args.max_tokens:
        print(f"(using the first {args.max_tokens} of {len(ids)} tokens; raise --max-tokens for more)")
        ids = ids[: args.max_tokens]
    ids = torch.tensor(ids, dtype=torch.long)
    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else None
    records = inspect_retrieval(model, ids, chunks)
    if args.top and chunks is None:
        records = sorted(records, key=lambda r: -max((i["weight"] for g in r["groups"] for i in g), default=0))[: args.top]
        records.sort(key=lambda r: r["chunk"])
    print(format_retrieval(records, ids, tokenizer, model.config.chunk_size))
    write_json(args.out, {"records": records})
    return 0


def _cmd_eval_compare(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from farsight.eval.needle import compare_summaries

    labels = args.labels.split(",") if args.labels else [Path(f).stem for f in args.results]
    if len(labels) != len(args.results):
        raise ValueError(f"--labels names {len(labels)} models for {len(args.results)} result files")
    summaries = {}
    for label, path in zip(labels, args.results):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist; write it with `farsight eval passkey ... --out {path}`")
        summaries[label] = json.loads(Path(path).read_text())
    table, series = compare_summaries(summaries, args.metric)
    print(f"{args.metric.replace('_', ' ')} %")
    print(table)
    if args.plot:
        from farsight.eval.plots import curves

        title = args.title or f"{next(iter(summaries.values())).get('task', 'needle')}: {args.metric.replace('_', ' ')}"
        print(f"wrote {curves(series, args.plot, args.metric.replace('_', ' ') + ' %', title)}")
    return 0


def _cmd_eval_bench(args: argparse.Namespace) -> int:
    from farsight.eval.bench import run_benchmarks

    return run_benchmarks(args.only.split(",") if args.only else None, quick=args.quick, json_path=args.json)


def _cmd_export(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from farsight.models.lm import CONFIG_FILE, WEIGHTS_FILE, load_model, resolve_model_dir

    source = resolve_model_dir(args.source)
    load_model(source)  # refuse to export a damaged checkpoint
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    print(f"exported {source} -> {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from farsight.data.tasks import make_filler, make_task
    from farsight.eval.efficiency import write_json
    from farsight.eval.needle import evaluate_needle_task, format_length, parse_length, results_table, trials_per_length
    from farsight.eval.plots import needle_heatmap

    start = time.perf_counter()
    model, tokenizer = _load(args.model)
    corpus = Path(args.corpus)
    if not (corpus / "meta.json").is_file():
        from farsight.data.token_files import prepare_corpus

        print(f"preparing the haystack corpus (Python standard library, byte tokens) in {corpus}")
        prepare_corpus(["stdlib"], tokenizer, corpus)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    trials = trials_per_length(lengths, args.trials, args.long_trials)
    task = make_task("passkey", tokenizer, make_filler("corpus", tokenizer, str(corpus), "val"), model.config.chunk_size)
    trained = getattr(model.config, "chunk_size", None)
    print(
        f"passkey retrieval with {args.model} ({model.num_parameters() / 1e6:.2f}M parameters), "
        f"haystacks of held-out Python source, {len(depths)} depths, lengths {', '.join(format_length(n) for n in lengths)}"
        + (f", chunk size {trained}" if trained else "")
    )
    summary = evaluate_needle_task(model, task, lengths, depths, trials, seed=args.seed, memory=args.memory, batch_size=args.batch_size)
    print(results_table(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(str(out / "passkey.json"), summary)
    heatmap = needle_heatmap(summary, out / "passkey-heatmap.png", title=f"passkey retrieval: {args.model}")
    print(f"wrote {heatmap}")
    print(f"demo finished in {time.perf_counter() - start:.0f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="farsight", description=__doc__)
    parser.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    data = sub.add_parser("data", help="prepare corpora as token files", description="Prepare corpora as token files.")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prep = data_sub.add_parser(
        "prepare",
        help="tokenize text sources into train/val token files",
        description="Tokenize text sources into train.bin/val.bin (split by document). Sources: stdlib, "
        "shakespeare, hf:NAME[:CONFIG][@SPLIT], jsonl:PATH or *.jsonl, a text file or a folder.",
    )
    prep.add_argument("--source", action="append", required=True, help="a text source (repeatable)")
    prep.add_argument("--tokenizer", default="byte", help="byte, gpt2, or a directory/file with tokenizer.json")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="fraction of documents held out (default 0.05)")
    prep.add_argument("--seed", type=int, default=0, help="seed of the document split")
    prep.set_defaults(func=_cmd_data_prepare)
    info = data_sub.add_parser("info", help="print a prepared dataset's metadata")
    info.add_argument("path")
    info.set_defaults(func=_cmd_data_info)

    tr = sub.add_parser("train", help="train a model from a YAML config", description="Train a model from a YAML config.")
    tr.add_argument("config", help="YAML file with sections model, data, optim, train")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.steps=100")
    tr.add_argument("--restart", action="store_true", help="start over: delete the checkpoints already in train.out_dir")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    tr.set_defaults(func=_cmd_train)

    gen = sub.add_parser("generate", help="sample text from a trained model", description="Sample text from a trained model.")
    gen.add_argument("--model", required=True, help="model directory or training run directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_generate)

    exp = sub.add_parser("export", help="copy a model out of a training run", description="Copy the model files of a run's newest checkpoint (or of a checkpoint directory) into a model directory.")
    exp.add_argument("source", help="training run directory or checkpoint directory")
    exp.add_argument("out", help="model directory to write")
    exp.set_defaults(func=_cmd_export)

    demo = sub.add_parser("demo", help="passkey retrieval from 1K to 1M tokens with the shipped DRT",
                          description="The main demo: the shipped 1M-parameter DRT, trained at 1K tokens, retrieves a passkey "
                          "from haystacks of up to 1M tokens; prints the table and writes a heatmap.")
    demo.add_argument("--model", default="models/demo-drt")
    demo.add_argument("--corpus", default="data/stdlib-byte", help="prepared byte-level corpus for the haystacks (made if missing)")
    demo.add_argument("--lengths", default="1k,4k,16k,64k,256k,1m")
    demo.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    demo.add_argument("--trials", type=int, default=2, help="trials per cell up to 64K tokens")
    demo.add_argument("--long-trials", type=int, default=1, help="trials per cell beyond 64K tokens")
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument("--memory", choices=["device", "host", "disk"], default="device")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="demo-results")
    demo.set_defaults(func=_cmd_demo)

    ev = sub.add_parser("eval", help="long-context evaluations and benchmarks", description="Long-context evaluations and benchmarks.")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="EVALUATION")
    for task, what in (
        ("passkey", "single needle: 'The passkey is: {P}.'"),
        ("multikey", "several passkeys under different keys, one asked"),
        ("niah2hop", "2-hop chain a->b->c among distractor chains"),
    ):
        p = ev_sub.add_parser(task, help=f"needle in a haystack: {what}", description=f"Needle in a haystack: {what}. "
                              "Exact match of all answer tokens (greedy) and first-token accuracy over lengths x depths.")
        p.add_argument("--model", required=True, help="model directory or training run directory")
        p.add_argument("--lengths", default="1k,4k,16k", help="comma-separated lengths, e.g. 1k,16k,1m (k = 1024)")
        p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
        p.add_argument("--trials", type=int, default=10, help="trials per (length, depth) cell")
        p.add_argument("--long-trials", type=int, default=None, help="trials per cell for lengths above 64K (default: --trials)")
        p.add_argument("--filler", choices=["corpus", "repeat"], default="corpus", help="haystack text")
        p.add_argument("--corpus", default="data/stdlib-byte", help="prepared dataset for corpus filler")
        p.add_argument("--split", default="val", help="split of --corpus used as filler (default: held-out val)")
        p.add_argument("--align", type=int, default=None, help="chunk alignment of the question (default: the model's chunk size)")
        p.add_argument("--batch-size", type=int, default=1, help="trials decoded together")
        p.add_argument("--memory", choices=["device", "host", "disk"], default="device", help="DRT chunk memory tier")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. digits=7")
        p.add_argument("--out", help="write the results as JSON")
        p.add_argument("--plot", help="write the length x depth heatmap PNG")
        p.set_defaults(func=_cmd_eval_needle, task=task)
    ppl = ev_sub.add_parser("ppl", help="perplexity vs evaluation length", description="Perplexity vs evaluation length on held-out documents.")
    ppl.add_argument("--model", action="append", required=True, help="model directory (repeat to compare)")
    ppl.add_argument("--corpus", required=True, help="prepared dataset")
    ppl.add_argument("--split", default="val")
    ppl.add_argument("--lengths", default="1k,2k,4k,8k")
    ppl.add_argument("--windows", type=int, default=8, help="windows per length")
    ppl.add_argument("--batch-size", type=int, default=4)
    ppl.add_argument("--memory", choices=["device", "host", "disk"], default="device")
    ppl.add_argument("--seed", type=int, default=0)
    ppl.add_argument("--out")
    ppl.add_argument("--plot")
    ppl.set_defaults(func=_cmd_eval_ppl)
    ret = ev_sub.add_parser("retrieval", help="show the chunks a DRT retrieves", description="Show, per chunk, the past chunks a DRT retrieves with their weights and text.")
    ret.add_argument("--model", required=True)
    source = ret.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a text file")
    source.add_argument("--corpus", help="a prepared dataset (with --document)")
    ret.add_argument("--split", default="val")
    ret.add_argument("--document", type=int, default=0)
    ret.add_argument("--chunks", help="comma-separated querying chunks to show (default: all)")
    ret.add_argument("--top", type=int, default=None, help="show only the N chunks with the most confident retrieval")
    ret.add_argument("--max-tokens", type=int, default=16384)
    ret.add_argument("--out")
    ret.set_defaults(func=_cmd_eval_retrieval)
    cmp_ = ev_sub.add_parser("compare", help="compare needle-task results of several models",
                             description="One table (and plot) of needle-task results written by --out: a row per length, a column per model.")
    cmp_.add_argument("results", nargs="+", help="JSON files written by `farsight eval passkey|multikey|niah2hop --out`")
    cmp_.add_argument("--labels", help="comma-separated column names (default: the file names)")
    cmp_.add_argument("--metric", default="exact_match", choices=["exact_match", "first_token", "needle_retrieved"])
    cmp_.add_argument("--plot", help="write accuracy vs length as a PNG")
    cmp_.add_argument("--title")
    cmp_.set_defaults(func=_cmd_eval_compare)
    bench = ev_sub.add_parser("bench", help="run the benchmarks and collect their figures", description="Run benchmarks/*.py and collect their figures.")
    bench.add_argument("--only", help="comma-separated subset, e.g. castle,drt")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--json", help="write all figures to one JSON file")
    bench.set_defaults(func=_cmd_eval_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError, RuntimeError) as exc:
        if getattr(args, "traceback", False):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
