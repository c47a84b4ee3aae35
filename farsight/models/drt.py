"""DRT: the Differentiable Retrieval-based Transformer with Grouped Cross-Attention (docs/design.md §2).

The paper's model built from the causal-retrieval component (farsight.models.causal_retrieval,
which lays out the stream, encodes chunks, retrieves and streams):
  1. lower layers: sliding-window self-attention (ALiBi) + SwiGLU, pre-norm;
  2. every chunk completed in the span goes through the bidirectional chunk encoder (in-chunk
     RoPE); its S real rows give the shared GCA keys/values, its LMK row the landmark key W_l l_k;
  3. for each of the G groups of upper layers: the LMK hidden state of chunk t at the group's
     input scores the landmark keys of chunks < t (W_h^g, scaled by 1/sqrt(d_model)), takes the
     top K (Gumbel noise in training only) and softmax weights over the clean scores; chunk t+1
     uses that retrieval in every layer of the group: h += SWA(norm h); h += GCA(norm h); h += MLP.
Memory is linear in the span apart from the [chunks x chunks] retrieval scores per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from farsight.config import ConfigBase, require
from farsight.layers import RMSNorm, TransformerBlock, swiglu_hidden_size
from farsight.models.causal_retrieval import CausalRetrievalLM, RetrievalBlock, check_retrieval_config
from farsight.models.transformer import TransformerConfig, init_weights


@dataclass
class DRTConfig(ConfigBase):
    vocab_size: int = 260
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    mlp_hidden: int | None = None
    lower_layers: int | None = None
    chunk_size: int = 64
    window: int = 512
    top_k: int = 8
    neighbors_before: int = 0
    neighbors_after: int = 0
    groups: int = 1
    encoder_layers: int = 2
    position: str = "alibi"
    rope_theta: float = 10000.0
    retriever: str = "learned"
    gumbel: bool = True
    gumbel_temperature: float = 1.0
    softmax_one: bool = True
    landmark_id: int | None = None
    pad_id: int | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1, got {value!r}")
        if self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; change one or set head_dim",
            )
            self.head_dim = self.d_model // self.n_heads
        if self.mlp_hidden is None:
            self.mlp_hidden = swiglu_hidden_size(self.d_model)
        check_retrieval_config(self)
        require(
            isinstance(self.window, int) and self.window >= self.chunk_size + 1,
            f"window={self.window} is smaller than a chunk and its landmark (chunk_size + 1 = {self.chunk_size + 1}); "
            "the next chunk must see the whole current chunk — raise window or lower chunk_size",
        )
        require(self.position in ("alibi", "rope"), f"position must be 'alibi' or 'rope', got {self.position!r}")

    @property
    def upper_layers(self) -> int:
        return self.n_layers - self.lower_layers

    def block_config(self) -> TransformerConfig:
        """The sliding-window + ALiBi block configuration shared with the BaseLM baseline."""
        return TransformerConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            mlp_hidden=self.mlp_hidden,
            attention="sliding",
            window=self.window,
            position=self.position,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            init_std=self.init_std,
        )


class DRTForCausalLM(CausalRetrievalLM):
    """The sliding-window lower and upper layers of `block_config()` around the component's
    retrieval; forward, the stream layout and `new_session` are CausalRetrievalLM's."""

    model_type: ClassVar[str] = "drt"
    config_class: ClassVar[type[ConfigBase]] = DRTConfig

    def __init__(self, config: DRTConfig) -> None:
        super().__init__(config)
        block_config = config.block_config()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.lower = nn.ModuleList(TransformerBlock(block_config) for _ in range(config.lower_layers))
        self.add_retrieval(block_config)
        self.upper = nn.ModuleList(RetrievalBlock(block_config, config.softmax_one) for _ in range(config.upper_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.init_std, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
