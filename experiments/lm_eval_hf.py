"""One lm-eval task at one length on a farsight model directory through lm-eval's standard "hf"
model (transformers with farsight's Auto classes), as a user without farsight's CLI runs it:

    python experiments/lm_eval_hf.py MODEL_DIR TASK LENGTH LIMIT TOP_K OUT

writes lm-eval's version, the chunks read and lm-eval's results to OUT (JSON), through a
temporary file renamed when whole. Used by experiments/ruler.sh and experiments/ruler-lines.sh.
"""

import json
import os
import sys

import lm_eval
import torch

import farsight.hf  # noqa: F401  (registers farsight's classes with transformers' Auto classes)


def main() -> None:
    directory, task, length, limit, top_k, out = sys.argv[1:]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's hf model assumes CUDA otherwise
    result = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={directory},dtype=bfloat16,device={device},retrieval_top_k={top_k}",
        tasks=[task],
        metadata={"max_seq_lengths": [int(length)]},
        limit=int(limit),
    )
    with open(f"{out}.tmp", "w") as handle:
        json.dump(
            {"lm_eval": lm_eval.__version__, "retrieval_top_k": int(top_k), "results": result["results"]},
            handle,
            indent=1,
            default=str,
        )
    os.replace(f"{out}.tmp", out)


if __name__ == "__main__":
    main()
