"""`farsight data prepare|prepare-sft|train-tokenizer|info`: tokenize text sources (or supervised examples) into token files, train a BPE tokenizer, and show a prepared dataset."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from farsight.cli.arguments import (
    add_force_argument,
    check_at_least,
    check_number,
    check_output_folder,
    claim_output,
    model_tokenizer,
)

logger = logging.getLogger(__name__)


def add_commands(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser(
        "data", help="prepare corpora as token files", description="Prepare corpora as token files."
    )
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare",
        help="tokenize text sources into train/val token files",
        description="Tokenize text sources into train.bin/val.bin (split by document). Sources: stdlib, "
        "shakespeare, hf:NAME[:CONFIG][@SPLIT], jsonl:PATH or *.jsonl, a text file or a folder.",
    )
    prepare.add_argument("--source", action="append", required=True, help="a text source (repeatable)")
    prepare.add_argument("--tokenizer", default="byte", help=prepare_tokenizer_help())
    prepare.add_argument(
        "--out", required=True, help="output directory: a new or empty folder, or a dataset to replace"
    )
    add_force_argument(prepare, "the dataset")
    prepare.add_argument(
        "--val",
        action="append",
        default=[],
        metavar="SOURCE",
        help="a source of held-out documents (repeatable): the validation split is these and nothing else, "
        "e.g. whole packages or books kept apart (default: --val-fraction of the --source documents)",
    )
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="fraction of the --source documents held out, by a hash of each document's id (default 0.05; not with --val)",
    )
    prepare.add_argument("--seed", type=int, default=0, help="seed of the document split (0 to 2**63 - 1)")
    prepare.add_argument(
        "--extensions",
        help="comma-separated extensions of the files read from a folder source (default: .txt,.md,.rst,.py)",
    )
    prepare.set_defaults(func=_prepare)
    sft = actions.add_parser(
        "prepare-sft",
        help="tokenize supervised examples (prompt -> completion) into token files with loss masks",
        description='Tokenize JSONL records {"prompt": ..., "completion": ...} or {"messages": [...]} into '
        "train/val token files whose loss covers the completions only (data.kind: sft; docs/training.md).",
    )
    sft.add_argument("--source", action="append", required=True, help="a JSONL file of training examples (repeatable)")
    sft.add_argument(
        "--val",
        action="append",
        default=[],
        help="a JSONL file of held-out examples (repeatable; default: --val-fraction of the --source records)",
    )
    sft.add_argument("--tokenizer", default="byte", help=prepare_tokenizer_help())
    sft.add_argument("--out", required=True, help="output directory: a new or empty folder, or a dataset to replace")
    add_force_argument(sft, "the dataset")
    sft.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="fraction of the --source records held out, by a hash of FILE:LINE (default 0.05; not with --val)",
    )
    sft.add_argument("--seed", type=int, default=0, help="seed of the record split (0 to 2**63 - 1)")
    sft.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="the most tokens an example may hold (prompt, completion and eos); longer ones are bad records",
    )
    sft.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="leave out bad records (invalid JSON, missing fields, empty completions, longer than --max-len) and "
        "count them, instead of stopping at the first",
    )
    sft.set_defaults(func=_prepare_sft)
    bpe = actions.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer on text sources",
        description="Train a byte-level BPE (Hugging Face tokenizers) on the documents of text sources and write "
        "OUT/tokenizer.json, which `data prepare --tokenizer OUT` and training configs take. Any text encodes "
        "(the 256 bytes are in the vocabulary); the same sources give the same tokenizer.",
    )
    bpe.add_argument(
        "--source", action="append", required=True, help="a text source, as data prepare takes (repeatable)"
    )
    bpe.add_argument("--vocab-size", type=int, default=16384, help="entries, special tokens included (default 16384)")
    bpe.add_argument("--min-frequency", type=int, default=2, help="the fewest occurrences a merge needs (default 2)")
    bpe.add_argument("--extensions", help="comma-separated extensions of the files read from a folder source")
    bpe.add_argument(
        "--out",
        required=True,
        help="output directory (tokenizer.json is written there): a new or empty folder, or a tokenizer to replace",
    )
    add_force_argument(bpe, "tokenizer.json")
    bpe.set_defaults(func=_train_tokenizer)
    info = actions.add_parser("info", help="print a prepared dataset's metadata")
    info.add_argument("path")
    info.set_defaults(func=_info)


def _check_val_split(args: argparse.Namespace, what: str) -> None:
    """--val and --val-fraction are one choice of held-out split; --val-fraction defaults to 0.05
    and must leave something to train on. `what`: the --source items it splits."""
    from farsight.errors import InputError

    if args.val and args.val_fraction is not None:
        raise InputError(
            f"--val-fraction {args.val_fraction} splits the --source {what}, but --val gives the held-out {what}; pass one of the two"
        )
    args.val_fraction = 0.05 if args.val_fraction is None else args.val_fraction
    check_number(args, "--val-fraction", 0, 1, open_low=True)
    if args.val_fraction >= 1:
        trained = "documents" if what == "documents" else "examples"
        raise InputError(
            f"--val-fraction must be below 1 so that some {trained} are trained on, got {args.val_fraction}"
        )


def _prepare(args: argparse.Namespace) -> int:
    from farsight.data.corpora import resolve_source
    from farsight.data.token_files import prepare_corpus
    from farsight.errors import InputError

    check_output_folder(args.out, "--out")
    claim_output(args.out, "dataset", args.force)
    check_at_least(args, {"--seed": 0})
    _check_val_split(args, "documents")
    sources: list = list(args.source)
    val_sources: list = list(args.val)
    if args.extensions is not None:
        extensions = [item.strip() for item in args.extensions.split(",") if item.strip()]

        def folders(specs: list) -> list[int]:
            return [i for i, spec in enumerate(specs) if Path(spec).is_dir() and not spec.lower().endswith(".jsonl")]

        if not extensions or not (folders(sources) or folders(val_sources)):
            raise InputError(
                f"--extensions {args.extensions!r} names the files to read from a folder source; "
                + (
                    "give at least one extension, e.g. .txt,.log"
                    if not extensions
                    else "no --source or --val is a folder"
                )
            )
        for specs in (sources, val_sources):
            for i in folders(specs):
                specs[i] = resolve_source(specs[i], extensions=extensions)
    meta = prepare_corpus(
        sources,
        _tokenizer(args.tokenizer),
        args.out,
        val_fraction=args.val_fraction,
        seed=args.seed,
        val_sources=val_sources,
        overwrite=args.force,
    )
    logger.info(
        f"wrote {args.out}: " + ", ".join(f"{s} {meta['splits'][s]['tokens']:,} tokens" for s in meta["splits"])
    )
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from farsight.data.corpora import resolve_source
    from farsight.data.tokenizers import train_bpe_tokenizer
    from farsight.errors import InputError
    from farsight.files import writing_folder
    from farsight.progress import progress_bar

    check_output_folder(args.out, "--out")
    claim_output(args.out, "tokenizer", args.force)
    check_at_least(args, {"--vocab-size": 260, "--min-frequency": 1})
    extensions = None
    if args.extensions is not None:
        extensions = [item.strip() for item in args.extensions.split(",") if item.strip()]
        if not extensions:
            raise InputError(f"--extensions {args.extensions!r} names no extension; give at least one, e.g. .txt,.log")
    folders = [spec for spec in args.source if Path(spec).is_dir() and not spec.lower().endswith(".jsonl")]
    if extensions and not folders:
        raise InputError(
            f"--extensions {args.extensions!r} names the files to read from a folder source; no --source is a folder"
        )
    sources = [
        resolve_source(spec, extensions=extensions) if extensions and spec in folders else resolve_source(spec)
        for spec in args.source
    ]

    read = 0

    def texts():
        nonlocal read
        with progress_bar(desc="reading", unit=" docs", dynamic_ncols=True) as bar:
            for source in sources:
                bar.set_description_str(f"reading {source.spec}")
                for document in source:
                    if document.text.strip():
                        read += 1
                        bar.update()
                        yield document.text

    tokenizer = train_bpe_tokenizer(texts(), args.vocab_size, args.min_frequency)
    if not read:
        raise InputError("the sources hold no text to learn merges from; pass sources with documents")
    what = "farsight data train-tokenizer"
    with writing_folder(args.out, "tokenizer", what, args.force, name=f"--out {args.out}", fix="pass another --out"):
        path = tokenizer.save(args.out)
    logger.info(f"wrote {path}: a byte-level BPE of {tokenizer.vocab_size:,} entries")
    return 0


def prepare_tokenizer_help() -> str:
    return "byte, gpt2, a directory/file with tokenizer.json, or a training run (its newest checkpoint's tokenizer)"


def _tokenizer(spec: str):
    """The tokenizer --tokenizer names: byte, gpt2, a tokenizer.json (or its folder), or a run or model directory's."""
    from farsight.data.tokenizers import load_tokenizer

    run = Path(spec)
    is_model = (run / "checkpoints").is_dir() or (run / "config.json").is_file()  # a run, or a model directory
    return model_tokenizer(spec) if is_model else load_tokenizer(spec)


def _prepare_sft(args: argparse.Namespace) -> int:
    from farsight.data.sft import prepare_sft

    check_output_folder(args.out, "--out")
    claim_output(args.out, "dataset", args.force)
    check_at_least(args, {"--seed": 0, "--max-len": 2})
    _check_val_split(args, "records")
    meta = prepare_sft(
        args.source,
        _tokenizer(args.tokenizer),
        args.out,
        val_sources=args.val,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_len=args.max_len,
        skip_bad_records=args.skip_bad_records,
        overwrite=args.force,
    )
    splits = meta["splits"]
    logger.info(
        f"wrote {args.out}: "
        + ", ".join(
            f"{s} {splits[s]['documents']:,} examples ({splits[s]['tokens']:,} tokens, {splits[s]['loss_tokens']:,} "
            f"in the loss, the longest {splits[s]['longest']:,})"
            for s in splits
        )
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    import json

    from farsight.data.token_files import load_meta, load_token_dataset

    meta = load_meta(args.path)
    for split in meta["splits"]:  # the token files as the meta describes them: a truncated one is refused here
        load_token_dataset(args.path, split)
    print(json.dumps(meta, indent=2))
    return 0
