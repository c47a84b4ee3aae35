"""Retrieval inspection (DRT paper Figures 4-7): which past chunks each chunk retrieves, with
weights and text, beside the chunk that uses them."""

from __future__ import annotations

from typing import Any

import torch

from farsight.errors import InputError, UnsupportedModelError
from farsight.models import DRTForCausalLM


def inspect_retrieval(
    model: DRTForCausalLM, ids: torch.Tensor, chunks: list[int] | None = None
) -> list[dict[str, Any]]:
    """ids [L] -> one record per querying chunk t (default: all that retrieved something):
    {"chunk": t, "groups": [[{"chunk": k, "weight": w, "neighbor": bool}, ...] per group]}, best
    first; "neighbor" marks a chunk read beside a retrieved one (docs/design.md §2.8), which
    carries that chunk's weight and follows the retrieved chunks.

    Chunk t's landmark made the retrieval; chunk t + 1 is the chunk that reads it.
    """
    if not isinstance(model, DRTForCausalLM):
        raise UnsupportedModelError(
            "retrieval inspection needs a DRT model; pass a model directory saved from a DRT run"
        )
    if model.config.retriever == "none":
        raise InputError("this model has retriever='none': it retrieves nothing")
    model.eval()
    ids = ids.reshape(1, -1)
    with torch.no_grad():
        info = model(ids, return_retrieval=True).retrieval
    n = info.indices[0].shape[1]
    wanted = range(n) if chunks is None else chunks
    records = []
    for t in wanted:
        if not 0 <= t < n:
            raise InputError(f"chunk {t} does not exist; the input has chunks 0..{n - 1}")
        groups = []
        for index, weight in zip(info.indices, info.weights):
            # slots 0..K-1 hold the retrieved chunks, the rest their neighbors (add_neighbors)
            read = [
                (int(k), float(w), slot >= model.config.top_k)
                for slot, (k, w) in enumerate(zip(index[0, t], weight[0, t]))
                if k >= 0
            ]
            ranked = sorted(read, key=lambda r: (r[2], -r[1]))
            groups.append([{"chunk": k, "weight": w, "neighbor": beside} for k, w, beside in ranked])
        if chunks is not None or any(groups):
            records.append({"chunk": t, "groups": groups})
    return records


def format_retrieval(
    records: list[dict[str, Any]], ids: torch.Tensor, tokenizer: Any, chunk_size: int, width: int = 100
) -> str:
    """Human-readable report: the querying chunk, the chunk it serves, and the retrieved chunks' text."""
    ids = ids.reshape(-1).tolist()

    def text(c: int) -> str:
        s = tokenizer.decode(ids[c * chunk_size : (c + 1) * chunk_size]).replace("\n", "⏎")
        return s if len(s) <= width else s[: width - 1] + "…"

    lines = []
    for rec in records:
        t = rec["chunk"]
        lines.append(f"chunk {t} (query)  | {text(t)}")
        if (t + 1) * chunk_size < len(ids):
            lines.append(f"chunk {t + 1} (target) | {text(t + 1)}")
        for g, group in enumerate(rec["groups"]):
            for rank, item in enumerate(group, 1):
                place = "beside" if item.get("neighbor") else f"#{rank}"
                lines.append(
                    f"  group {g} {place} chunk {item['chunk']:>5} w={item['weight']:.3f} | {text(item['chunk'])}"
                )
        lines.append("")
    return "\n".join(lines)
