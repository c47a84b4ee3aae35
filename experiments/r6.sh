#!/usr/bin/env bash
# R6 efficiency on this machine: training step DRT / BaseLM, decode latency vs context, streaming
# prefill throughput and memory per tier (benchmarks/drt.py), CASTLE (benchmarks/castle.py) and
# causal vs sliding training throughput (benchmarks/train_throughput.py), and append latency across a
# buffer doubling (benchmarks/buffers.py). Run on an idle machine.
set -euo pipefail
mkdir -p results/r6
.venv/bin/farsight eval bench --only train_throughput,castle,drt,buffers --json results/r6/bench.json
