"""Activation checkpointing (train.activation_checkpointing): the peak memory and the time of one
training step with and without it, on the CPU.

    python benchmarks/activation_checkpointing.py [--config configs/lm/pretrain/drt-x2.yaml]
        [--tokens 16384] [--precision NAME] [--rounds 3] [--json PATH]

The config's model, built for the byte tokenizer, takes full AdamW steps as the trainer takes them
(farsight.eval.efficiency.training_step: loss-only forward, fused AdamW, denormals flushed) in the
config's train.precision (or --precision), on random tokens, --tokens per step in rows of the
config's data.seq_len. Memory: each setting in a fresh process (farsight.eval.efficiency.run_isolated),
where a first step allocates the optimizer state and the next one's peak growth of the resident
memory is measured (measure_peak_memory: the activations, the gradients and the temporaries of the
step), along with the process's peak RSS. Time: one more process steps the model with and without
checkpointing in turn (time_interleaved, --rounds rounds after one untimed step of each), so that
a shared host's slow and fast spells fall on both; the time ratio is the median (and range) of the
same-round ratios. The last lines give the checkpointed step's memory and time over the plain one's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from farsight.data.tokenizers import ByteTokenizer
from farsight.eval.efficiency import (
    format_table,
    machine_description,
    measure_peak_memory,
    paired_ratio,
    run_isolated,
    time_interleaved,
    training_step,
    write_json,
)
from farsight.models import build_model
from farsight.process_memory import peak_rss_bytes
from farsight.train.config import PRECISIONS, load_train_config


def _model_and_step(case: dict) -> tuple[torch.nn.Module, object, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(case["model"], ByteTokenizer()).train()
    rows = max(1, case["tokens"] // case["seq_len"])
    ids = torch.randint(0, 256, (rows, case["seq_len"]))
    return model, training_step(model, ids, case["precision"]), ids


def _memory_case(case: dict) -> dict:
    model, step, ids = _model_and_step(case)
    model.set_activation_checkpointing(case["checkpointing"])
    step()  # the optimizer state is allocated before the measurement
    peak = measure_peak_memory(step)
    return {"tokens": ids.numel(), "step_peak_mb": peak / 2**20, "process_peak_rss_mb": peak_rss_bytes() / 2**20}


def _time_case(case: dict) -> dict:
    model, step, _ = _model_and_step(case)

    def with_checkpointing(enabled: bool):
        return lambda: (model.set_activation_checkpointing(enabled), step())

    times = time_interleaved(
        {"plain": with_checkpointing(False), "checkpointed": with_checkpointing(True)}, rounds=case["rounds"]
    )
    return {"times": times, "ratio": paired_ratio(times["checkpointed"], times["plain"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/lm/pretrain/drt-x2.yaml", help="training config of the model")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the config's train.precision")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (a step of each setting per round)")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    config = load_train_config(args.config)
    precision = args.precision or config.train.precision
    if precision == "auto":
        from farsight.train.precision import resolve_precision

        precision = resolve_precision("auto", torch.device("cpu")).name
    base = {
        "model": config.model,
        "seq_len": int(config.data.get("seq_len", args.tokens)),
        "tokens": args.tokens,
        "precision": precision,
    }
    rows = []
    for checkpointing in (False, True):
        result = run_isolated(_memory_case, base | {"checkpointing": checkpointing}, timeout=3600)
        if "error" in result:
            raise SystemExit(f"activation_checkpointing={checkpointing}: {result['error']}")
        rows.append({"activation_checkpointing": checkpointing, **result})
    timed = run_isolated(_time_case, base | {"rounds": args.rounds}, timeout=3600)
    if "error" in timed:
        raise SystemExit(f"timing: {timed['error']}")
    for row, name in zip(rows, ("plain", "checkpointed")):
        row["step_s"] = statistics.median(timed["times"][name])
    plain, checkpointed = rows
    ratios = {
        "step_peak_ratio": checkpointed["step_peak_mb"] / plain["step_peak_mb"],
        "process_peak_ratio": checkpointed["process_peak_rss_mb"] / plain["process_peak_rss_mb"],
        "step_time_ratio": timed["ratio"],
    }
    print(f"{args.config}: {base['tokens']} tokens per step in rows of {base['seq_len']}, {precision}")
    columns = ["activation_checkpointing", "tokens", "step_peak_mb", "process_peak_rss_mb", "step_s"]
    print(format_table(rows, columns))
    time_ratio = timed["ratio"]
    print(
        f"checkpointed / plain: step peak {ratios['step_peak_ratio']:.3f}, process peak "
        f"{ratios['process_peak_ratio']:.3f}, step time {time_ratio['median']:.3f} "
        f"({time_ratio['min']:.3f}-{time_ratio['max']:.3f} over {args.rounds} rounds)"
    )
    payload = {"benchmark": "activation_checkpointing", "machine": machine_description(), "config": args.config}
    payload |= {"precision": precision, "seq_len": base["seq_len"], "rows": rows, **ratios, "times": timed["times"]}
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
