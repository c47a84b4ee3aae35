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
    tr.add_argument("--restart", action="store_true", help="ignore existing checkpoints in train.out_dir")
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
