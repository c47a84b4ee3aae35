"""CASTLE: causal attention with lookahead keys (and CASTLE-SWL, its sliding-window variant).

All six inputs (qu, ku, vu: lookahead query/key/value; qc, kc, vc: causal query/key/value) are
[B, T, H, d]. `castle_attention` is the training path (O(T^2 d) time, O(T d) memory, custom
backward); `castle_prefill` / `castle_decode` with a `CastleCache` are the inference path;
`castle_recurrent` and `castle_parallel_reference` are slow ground truths for tests.
"""

from farsight.ops.castle.blockwise import CastleCache, castle_attention, castle_decode, castle_prefill
from farsight.ops.castle.reference import castle_parallel_reference, castle_recurrent

__all__ = [
    "CastleCache",
    "castle_attention",
    "castle_decode",
    "castle_parallel_reference",
    "castle_prefill",
    "castle_recurrent",
]
