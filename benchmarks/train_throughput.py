"""Training throughput of the baselines: standard causal attention vs sliding-window attention.

    python benchmarks/train_throughput.py [--quick] [--json PATH]

Each case (attention kind x sequence length) runs in a fresh process: a LLaMA-style model
(d_model 256, 4 layers, 4 heads, byte vocabulary) takes full AdamW steps on random tokens with
a fixed number of tokens per step; the table gives tokens/s (median step) and the peak-memory
growth of one step, and the sliding/causal ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from farsight.eval.efficiency import format_table, machine_description, measure_peak_memory, run_isolated, time_fn, write_json
from farsight.models import TransformerConfig, TransformerForCausalLM

TOKENS_PER_STEP = 8192
WINDOW = 256


def _case(case: dict) -> dict:
    torch.manual_seed(0)
    extra = {"window": WINDOW} if case["attention"] == "sliding" else {}
    config = TransformerConfig(vocab_size=260, d_model=256, n_layers=4, n_heads=4, attention=case["attention"], **extra)
    model = TransformerForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    length = case["length"]
    ids = torch.randint(0, 256, (max(1, TOKENS_PER_STEP // length), length))

    def step() -> None:
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # optimizer state allocated before the memory measurement
    peak = measure_peak_memory(step)
    seconds = time_fn(step, warmup=0, repeat=case["repeat"])
    return {"tokens_per_s": ids.numel() / seconds, "step_s": seconds, "peak_mb": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two short lengths, one timed step")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    lengths = [512, 1024] if args.quick else [512, 1024, 2048, 4096, 8192]
    repeat = 1 if args.quick else 3
    rows = []
    start = time.perf_counter()
    for length in lengths:
        row: dict = {"length": length}
        for attention in ("causal", "sliding"):
            result = run_isolated(_case, {"attention": attention, "length": length, "repeat": repeat})
            if "error" in result:
                row[f"{attention} error"] = result["error"]
                continue
            row[f"{attention} tok/s"] = result["tokens_per_s"]
            row[f"{attention} peak MB"] = result["peak_mb"]
        if "causal tok/s" in row and "sliding tok/s" in row:
            row["speed sliding/causal"] = row["sliding tok/s"] / row["causal tok/s"]
            row["memory sliding/causal"] = row["sliding peak MB"] / max(row["causal peak MB"], 1e-9)
        rows.append(row)
        print(f"  length {length} done ({time.perf_counter() - start:.0f}s)", flush=True)
    columns = ["length", "causal tok/s", "sliding tok/s", "speed sliding/causal", "causal peak MB", "sliding peak MB", "memory sliding/causal"]
    print(f"\nTraining throughput, d_model 256, 4 layers, 4 heads, {TOKENS_PER_STEP} tokens/step, sliding window {WINDOW}")
    print(format_table(rows, columns))
    write_json(args.json, {"benchmark": "train_throughput", "machine": machine_description(), "rows": rows})


if __name__ == "__main__":
    main()
