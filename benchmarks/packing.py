"""Packed vs length-bucketed supervised batches (data.pack): training throughput on the
summarization stand-in's fine-tune.

    .venv/bin/python benchmarks/packing.py --out results/packing.json
    .venv/bin/python benchmarks/packing.py [--config configs/lm/summarize/drt-x1.yaml] [--steps 10]
        [--seq-len N] [--batch-tokens N] [--d-model N] [--n-layers N] [--precision P]
        [--only padded|packed] [--out JSON]

The fine-tune of configs/lm/summarize/ (drt-x1 by default; baselm.yaml for the sliding-window
baseline): Python modules of 2K to 64K byte tokens in, their docstring's summary line out, the
loss on the answer only, on data/summarize-byte (built here when missing, as
experiments/summarize.sh builds it: experiments/summarize-data.py from the installed packages'
sources, then `farsight data prepare-sft`; a few minutes). The config's model (its size, or
--d-model / --n-layers), initialised at random with the same seed for both runs (throughput needs
no pre-trained weights), trains through farsight's Trainer (`farsight train`'s step: AdamW,
gradient clipping, the config's precision, eager: `Trainer._train_step`, timed around each
step), once on each kind of batch, in one process, on the same examples (the same split,
seq_len and too_long) and seed:

    padded   data.pack: false, today's batches: examples of one length bucket, padded to the longest
    packed   data.pack: true: examples end to end in batch_tokens // seq_len rows of at most seq_len
             tokens, each example attending only to itself (document_ids)

Each takes one warm-up step, then --steps timed steps (forward, backward, optimizer, the
batch's assembly included), the two taking their steps in turn (a slow spell of a shared host
falls on both). For each the table gives the token positions processed (the batches' [rows,
width], padding included), the real tokens (those with a label: not padding), the fraction of
positions that were padding, the examples trained on, and the real tokens per second; the last
line is the ratio packed / padded of real tokens per second, over all the steps and round by
round (the median and range of the ratios of the two steps of a round). The two draw their
examples from the same pool but not the same ones (buckets draw by bucket, packing uniformly),
so their steps hold different lengths; real tokens per second is what compares them. --out
writes the table, the step times, the settings and the machine as JSON.

The defaults (the config's model, seq_len and batch_tokens of 64K tokens, precision; 10 timed
steps) keep a run to about 3 minutes on 2 CPU cores; --seq-len leaves out the longer examples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from farsight.data.batches import build_batch_source  # noqa: E402
from farsight.eval.efficiency import format_table, machine_description, write_json  # noqa: E402
from farsight.train.config import TrainConfig, load_train_config  # noqa: E402
from farsight.train.precision import flush_denormals  # noqa: E402
from farsight.train.trainer import Trainer  # noqa: E402

DEFAULT_CONFIG = "configs/lm/summarize/drt-x1.yaml"
STAND_IN_DATA = "data/summarize-byte"


def ensure_data(path: Path) -> None:
    """Build the stand-in's dataset as experiments/summarize.sh does, when it is missing."""
    if (path / "meta.json").exists():
        return
    if path.resolve() != (ROOT / STAND_IN_DATA).resolve():
        raise SystemExit(f"{path} holds no prepared dataset; prepare it with `farsight data prepare-sft` first")
    jsonl = ROOT / "data" / "summarize"
    if not (jsonl / "manifest.json").exists():
        print(f"building {jsonl} from the installed packages' sources (a few minutes)", flush=True)
        subprocess.run(
            [sys.executable, "experiments/summarize-data.py", "--source", "site-packages", "--out", str(jsonl)],
            cwd=ROOT,
            check=True,
        )
    print(f"preparing {path}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "farsight.cli", "-q", "data", "prepare-sft", "--source", str(jsonl / "train.jsonl"),
         "--val", str(jsonl / "val.jsonl"), "--tokenizer", "byte", "--max-len", "65536", "--out", str(path)],
        cwd=ROOT,
        check=True,
    )  # fmt: skip


def run_config(args: argparse.Namespace, pack: bool, out_dir: Path) -> TrainConfig:
    """The config's fine-tune as a throughput run: random initialisation, no evaluation, eager."""
    raw = load_train_config(ROOT / args.config).to_dict()
    raw["data"] |= {"pack": pack, "too_long": "skip"}
    raw["data"] |= {k: v for k, v in (("seq_len", args.seq_len), ("batch_tokens", args.batch_tokens)) if v is not None}
    if args.data:
        raw["data"]["path"] = args.data
    raw["model"] |= {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers)) if v is not None}
    raw["train"] |= {
        "steps": args.steps + 1,
        "seed": args.seed,
        "init_from": None,
        "out_dir": str(out_dir),
        "log_interval": 1,
        "eval_interval": args.steps + 1,
        "eval_batches": 0,
        "checkpoint_interval": args.steps + 1,
        "keep_last": 1,
        "compile": False,
        "progress": False,
        "device": "cpu",
    }
    if args.precision:
        raw["train"]["precision"] = args.precision
    return TrainConfig.from_dict(raw)


def examples_in(batch: dict[str, torch.Tensor]) -> int:
    """The examples a batch holds: one a row, or each packed row's documents."""
    if "document_ids" not in batch:
        return int(batch["input_ids"].shape[0])
    real = batch["labels"] != -100
    return sum(len(batch["document_ids"][row][real[row]].unique()) for row in range(real.shape[0]))


def measure(args: argparse.Namespace, modes: list[bool], scratch: Path) -> list[dict[str, Any]]:
    """Each mode's trainer takes a warm-up step, then the modes take their timed steps in turn,
    a step of each per round, so that a slow or fast spell of a shared host falls on both."""
    names = ["packed" if pack else "padded" for pack in modes]
    configs = [run_config(args, pack, scratch / name) for pack, name in zip(modes, names)]
    trainers = [Trainer(config) for config in configs]
    seconds: list[list[float]] = [[] for _ in modes]
    tokens, real, losses = [0] * len(modes), [0] * len(modes), [0.0] * len(modes)
    per_step: list[list[int]] = [[] for _ in modes]
    try:
        with flush_denormals(torch.device("cpu")):  # as Trainer.fit steps
            for step in range(args.steps + 1):
                for i, trainer in enumerate(trainers):
                    trainer.wrapped.train()
                    start = time.perf_counter()
                    losses[i], _, done = trainer._train_step()
                    if step:  # step 0 is the warm-up
                        seconds[i].append(time.perf_counter() - start)
                        tokens[i] += done
                        real[i] += trainer._step_real_tokens
                        per_step[i].append(trainer._step_real_tokens)
    finally:
        for trainer in trainers:
            trainer.close()
    rows = []
    for i, (name, config) in enumerate(zip(names, configs)):
        source = build_batch_source(config.data, config.train.seed, config.model)
        total = sum(seconds[i])
        rows.append(
            {
                "batches": name,
                "steps": len(seconds[i]),
                "seconds": total,
                "positions": tokens[i],
                "real tokens": real[i],
                "padding": 1 - real[i] / tokens[i],
                "examples": sum(examples_in(source.train_batch(step, 0, 0)) for step in range(1, args.steps + 1)),
                "real tokens/s": real[i] / total,
                "positions/s": tokens[i] / total,
                "step seconds": seconds[i],
                "real per step": per_step[i],
                "last loss": losses[i],
            }
        )
    return rows


def packed_over_padded(padded: dict[str, Any], packed: dict[str, Any]) -> tuple[float, list[float]]:
    """Packed over padded real tokens per second: over all the steps, and for each round."""
    rounds = [
        (real / seconds) / (real_padded / seconds_padded)
        for real, seconds, real_padded, seconds_padded in zip(
            packed["real per step"], packed["step seconds"], padded["real per step"], padded["step seconds"]
        )
    ]
    return packed["real tokens/s"] / padded["real tokens/s"], rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"a summarization fine-tune (default {DEFAULT_CONFIG})"
    )
    parser.add_argument("--data", help="the prepared supervised examples (default: the config's data.path)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each run, after one warm-up (default 10)")
    parser.add_argument("--seq-len", type=int, help="data.seq_len: the longest example (default: the config's)")
    parser.add_argument("--batch-tokens", type=int, help="data.batch_tokens (default: the config's)")
    parser.add_argument("--d-model", type=int, help="the model's width (default: the config's)")
    parser.add_argument("--n-layers", type=int, help="the model's layers (default: the config's)")
    parser.add_argument("--precision", help="train.precision (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["padded", "packed"], help="run one half only (a dry run)")
    parser.add_argument("--out", help="write a JSON record here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    config = load_train_config(ROOT / args.config)
    data = Path(args.data or config.data["path"])
    ensure_data(data if data.is_absolute() else ROOT / data)
    modes = [mode == "packed" for mode in ("padded", "packed") if args.only in (None, mode)]
    with tempfile.TemporaryDirectory(prefix="farsight-packing-") as scratch:
        rows = measure(args, modes, Path(scratch))
    columns = ["batches", "steps", "seconds", "positions", "real tokens", "padding", "examples", "real tokens/s"]
    settings = run_config(args, False, Path("."))
    print(f"{args.config}: model {json.dumps(settings.model)}, {settings.train.precision}")
    print(
        f"seq_len {settings.data['seq_len']:,}, batch_tokens {settings.data['batch_tokens']:,}, "
        f"{args.steps} timed steps after one warm-up"
    )
    print(format_table(rows, columns))
    payload: dict[str, Any] = {
        "benchmark": "packing",
        "command": " ".join(["benchmarks/packing.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config,
        "model": settings.model,
        "data": {k: v for k, v in settings.data.items() if k != "pack"},
        "precision": settings.train.precision,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": rows,
        "machine": machine_description(),
        "torch_threads": torch.get_num_threads(),
    }
    if len(rows) == 2:
        ratio, rounds = packed_over_padded(*rows)
        payload["packed_over_padded_real_tokens_per_s"] = ratio
        payload["packed_over_padded_by_round"] = {
            "median": statistics.median(rounds),
            "min": min(rounds),
            "max": max(rounds),
        }
        print(
            f"packed / padded, real tokens per second: {ratio:.2f}x over all steps "
            f"(round by round: median {statistics.median(rounds):.2f}x, {min(rounds):.2f}x to {max(rounds):.2f}x)"
        )
    write_json(args.out, payload)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
