"""`farsight demo`: the shipped 1M-parameter DRT retrieves a passkey from haystacks of 1K to 1M tokens."""

from __future__ import annotations

import argparse
import logging

from farsight.cli.arguments import (
    add_dtype_argument,
    add_force_argument,
    add_memory_argument,
    add_model_argument,
    add_needle_grid_arguments,
    check_at_least,
    check_memory_for,
    check_output_folder,
    claim_output,
    load_model_and_tokenizer,
    needle_grid,
)
from farsight.errors import UnsupportedModelError

logger = logging.getLogger(__name__)


def add_commands(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="passkey retrieval from 1K to 1M tokens with the shipped DRT",
        description="The main demo: the shipped 1M-parameter DRT, trained at 1K tokens, retrieves a passkey "
        "from haystacks of up to 1M tokens; prints the table and writes a heatmap.",
    )
    add_model_argument(demo, default="models/demo-drt")
    demo.add_argument(
        "--corpus", default="data/stdlib-byte", help="prepared byte-level corpus for the haystacks (made if missing)"
    )
    add_needle_grid_arguments(demo, lengths="1k,4k,16k,64k,256k,1m", trials=2, long_trials=1)
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument(
        "--align",
        type=int,
        default=1,
        help="the question ends on a multiple of this (default 1: each trial's question at its own "
        "offset within a chunk, unpadded; the chunk size pads each prompt to a chunk boundary, the paper's setup)",
    )
    add_memory_argument(demo)
    add_dtype_argument(demo)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="demo-results", help="directory for passkey.json and passkey-heatmap.png")
    add_force_argument(demo, "the results")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from farsight.data.tasks import make_filler, make_task
    from farsight.eval.efficiency import write_json
    from farsight.eval.needle import evaluate_needle_task, format_length, question_offsets_label, results_table
    from farsight.eval.plots import needle_heatmap
    from farsight.files import writing_folder
    from farsight.models import DRTForCausalLM

    start = time.perf_counter()
    check_output_folder(args.out, "--out")
    claim_output(args.out, "results", args.force)
    check_at_least(args, {"--batch-size": 1, "--align": 1, "--seed": 0})
    lengths, depths, trials = needle_grid(args)
    check_memory_for(args, lengths, trials)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    if not isinstance(model, DRTForCausalLM):
        raise UnsupportedModelError(
            f"the demo shows a DRT's retrieval but {args.model} is a {type(model).__name__}; pass a DRT model directory"
        )
    corpus = Path(args.corpus)
    if not (corpus / "meta.json").is_file():
        from farsight.data.token_files import prepare_corpus

        logger.info(f"preparing the haystack corpus (Python standard library, byte tokens) in {corpus}")
        prepare_corpus(["stdlib"], tokenizer, corpus)
    task = make_task("passkey", tokenizer, make_filler("corpus", tokenizer, str(corpus), "val"), args.align)
    print(
        f"passkey retrieval with {args.model} ({model.num_parameters() / 1e6:.2f}M parameters), "
        f"haystacks of held-out Python source, {len(depths)} depth{'s' if len(depths) != 1 else ''}, lengths {', '.join(format_length(n) for n in lengths)}, "
        f"chunk size {model.config.chunk_size}, questions ending at: {question_offsets_label(model, task)}"
    )
    summary = evaluate_needle_task(
        model,
        task,
        lengths,
        depths,
        trials,
        seed=args.seed,
        memory=args.memory,
        kv_dtype=args.kv_dtype,
        batch_size=args.batch_size,
    )
    print(results_table(summary))
    out = Path(args.out)
    with writing_folder(out, "results", "farsight demo", args.force, name=f"--out {out}", fix="pass another --out"):
        out.mkdir(exist_ok=True)
        write_json(str(out / "passkey.json"), summary)
        heatmap = needle_heatmap(summary, out / "passkey-heatmap.png", title=f"passkey retrieval: {args.model}")
    logger.info(f"wrote {heatmap}")
    logger.info(f"demo finished in {time.perf_counter() - start:.0f}s")
    return 0
