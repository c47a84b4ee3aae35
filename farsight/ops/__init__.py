"""Pure tensor functions, each beside a small readable reference and, where it pays, a Triton kernel:

- `gca(q, k, v, index, weight)`: grouped cross-attention over retrieved chunks (farsight.ops.gca);
- `castle_attention(qu, ku, vu, qc, kc, vc)`: CASTLE's exact parallel form, with `castle_prefill` /
  `castle_decode` for the UQ-KV cache (farsight.ops.castle);
- `sliding_window_attention(q, k, v, window)`: causal attention over the last `window` keys
  (farsight.ops.window);
- `retrieval_scores` / `retrieval_topk`: DRT's chunk retrieval (farsight.ops.retrieval).

`farsight.ops.gca` is the package of that op and, called, the op itself.
"""

from farsight.ops import gca
from farsight.ops.castle import CastleCache, castle_attention, castle_decode, castle_prefill
from farsight.ops.retrieval import retrieval_scores, retrieval_topk
from farsight.ops.window import sliding_window_attention

__all__ = [
    "CastleCache",
    "castle_attention",
    "castle_decode",
    "castle_prefill",
    "gca",
    "retrieval_scores",
    "retrieval_topk",
    "sliding_window_attention",
]
