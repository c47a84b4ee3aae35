"""nn.Modules built on farsight.ops: norms, MLP, positions, attention kinds (window, causal,
CASTLE), grouped cross-attention, blocks."""

from farsight.layers.attention import BidirectionalAttention, CausalSelfAttention, SlidingWindowAttention, padding_mask
from farsight.layers.block import TransformerBlock
from farsight.layers.castle import CastleAttention, CastleSWLAttention, castle_heads_for_parity
from farsight.layers.gca import GroupedCrossAttention
from farsight.layers.kinds import ATTENTION_KINDS, build_attention, check_takes_documents, register_attention
from farsight.layers.kv_cache import KVCache, SlidingKVCache
from farsight.layers.mlp import SwiGLU, swiglu_hidden_size, swiglu_reference
from farsight.layers.norm import RMSNorm, rms_norm_reference
from farsight.layers.position import RotaryEmbedding, alibi_slopes, rotary_reference

__all__ = [
    "ATTENTION_KINDS",
    "BidirectionalAttention",
    "CastleAttention",
    "CastleSWLAttention",
    "CausalSelfAttention",
    "GroupedCrossAttention",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "SlidingKVCache",
    "SlidingWindowAttention",
    "SwiGLU",
    "TransformerBlock",
    "alibi_slopes",
    "build_attention",
    "castle_heads_for_parity",
    "check_takes_documents",
    "padding_mask",
    "register_attention",
    "rms_norm_reference",
    "rotary_reference",
    "swiglu_hidden_size",
    "swiglu_reference",
]
