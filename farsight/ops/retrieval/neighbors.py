"""Reading the chunks next to each retrieved one (farsight's extension, docs/design.md §2.8).

A chunk is the unit of retrieval, but the evidence a question needs need not sit inside one
chunk: a passkey or a "KEY is: VALUE" line can start in one chunk and end in the next. The
retriever ranks chunks one at a time, so the half it did not pick is read only if it also
ranks among the top k. `add_neighbors` widens each retrieval so that every retrieved chunk
brings the `before` chunks preceding it and the `after` chunks following it, each with the
retrieved chunk's weight (GCA's softmax_1 lets a slot ignore a chunk that does not help, so a
neighbor that holds nothing adds little). A neighbor is read only where it is itself a
candidate of that retrieval, and never twice.
"""

from __future__ import annotations

import torch


def neighbor_offsets(before: int, after: int) -> list[int]:
    """The offsets a retrieved chunk brings along, nearest first on each side: -1, ..., -before,
    then 1, ..., after."""
    return [-i for i in range(1, before + 1)] + list(range(1, after + 1))


def add_neighbors(
    index: torch.Tensor, weight: torch.Tensor, before: int, after: int, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """index [B, m, K] retrieved chunk ids (-1 empty), weight [B, m, K]; low, high [B, m]: the
    candidates of retrieval i in row b are the chunks j with low[b, i] <= j < high[b, i] ->
    (index [B, m, K (1 + before + after)], weight): the K retrieved chunks first, unchanged, then
    per offset of `neighbor_offsets` the K chunks that far from them, each weighed as the chunk
    it neighbors. A neighbor outside its retrieval's candidates, of an empty slot, or already in
    an earlier slot (a retrieved chunk, or another's neighbor) is an empty slot (-1, weight 0)."""
    offsets = neighbor_offsets(before, after)
    if not offsets:
        return index, weight
    valid = index >= 0
    near = [torch.where(valid, index + o, torch.full_like(index, -1)) for o in offsets]
    wide = torch.cat([index, *near], dim=-1)  # [B, m, K (1 + before + after)]
    weights = weight.repeat(1, 1, 1 + len(offsets))
    inside = (wide >= low[..., None]) & (wide < high[..., None]) & (wide >= 0)
    inside[..., : index.shape[-1]] = valid
    wide = torch.where(inside, wide, torch.full_like(wide, -1))
    # a slot repeating an earlier slot's chunk is dropped: [B, m, M, M] over M = K (1 + before + after)
    same = (wide[..., :, None] == wide[..., None, :]) & (wide[..., None, :] >= 0)
    earlier = torch.ones(same.shape[-1], same.shape[-1], dtype=torch.bool, device=index.device).tril(-1)
    repeated = (same & earlier).any(-1)
    keep = inside & ~repeated
    return torch.where(keep, wide, torch.full_like(wide, -1)), weights * keep
