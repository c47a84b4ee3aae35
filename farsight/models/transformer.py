"""LLaMA-style decoder-only transformer (RMSNorm, SwiGLU, RoPE/ALiBi) with a pluggable attention kind.

`attention` picks the self-attention module from farsight.layers.ATTENTION_KINDS: "causal"
(standard), "sliding" (sliding window + ALiBi, the DRT paper's BaseLM), "castle" and "castle-swl"
(lookahead keys). Decoding runs through `new_session()` with the attention kind's own caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from farsight.config import ConfigBase, require
from farsight.errors import InputError
from farsight.layers import ATTENTION_KINDS, RMSNorm, TransformerBlock, check_takes_documents, swiglu_hidden_size
from farsight.models.lm import CausalLMOutput, PretrainedLM, check_input_ids, check_packed_input, checked_labels
from farsight.models.session import Session

POSITIONS = ("rope", "alibi", "none")


@dataclass
class TransformerConfig(ConfigBase):
    vocab_size: int = 260
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int | None = None
    mlp_hidden: int | None = None
    attention: str = "causal"
    window: int | None = None
    lookahead_window: int | None = None
    position: str | None = None
    rope_theta: float = 10000.0
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
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                "change one of them or set head_dim explicitly",
            )
            self.head_dim = self.d_model // self.n_heads
        require(self.head_dim >= 1, f"head_dim must be >= 1, got {self.head_dim}")
        if self.mlp_hidden is None:
            self.mlp_hidden = swiglu_hidden_size(self.d_model)
        require(self.mlp_hidden >= 1, f"mlp_hidden must be >= 1, got {self.mlp_hidden}")
        kind = ATTENTION_KINDS.get(self.attention)
        require(kind is not None, f"attention={self.attention!r} is unknown; choose one of {sorted(ATTENTION_KINDS)}")
        allowed = getattr(kind, "positions", ("rope", "none"))
        if self.position is None:
            self.position = allowed[0]
        require(
            self.position in allowed,
            f"position={self.position!r} is not supported by attention={self.attention!r}; choose one of {list(allowed)}",
        )
        if self.position == "rope":
            require(self.head_dim % 2 == 0, f"rotary positions need an even head_dim, got {self.head_dim}")
        uses = getattr(kind, "config_fields", ())
        for name in ("window", "lookahead_window"):
            value = getattr(self, name)
            if name in uses:
                require(
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"{name} must be an integer >= 1 for attention={self.attention!r}, got {value!r}",
                )
            else:
                require(value is None, f"{name} is not used by attention={self.attention!r}; remove it from the config")
        require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")


def init_weights(module: nn.Module, std: float, n_layers: int) -> None:
    """GPT-2 style: N(0, std) everywhere, residual output projections scaled by 1/sqrt(2 n_layers)."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            residual = name.endswith(("attn.out", "mlp.down", "cross.out"))
            nn.init.normal_(sub.weight, 0.0, std / math.sqrt(2 * n_layers) if residual else std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, 0.0, std)


class TransformerForCausalLM(PretrainedLM):
    model_type: ClassVar[str] = "transformer"
    config_class: ClassVar[type[ConfigBase]] = TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.init_std, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_caches(self) -> list[Any]:
        return [block.attn.new_cache() for block in self.blocks]

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        caches: list[Any] | None = None,
        return_logits: bool = True,
        return_hidden: bool = False,
        document_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T] -> logits [B, T, V]; with `caches` the ids continue the cached sequence.
        return_logits=False (with labels): the loss alone, logits None (`logits_and_loss`).
        return_hidden: the final norm's output [B, T, D] as `hidden` instead (no head, no loss).
        document_ids [B, T] (packed rows, farsight.ops.documents): every token attends only to
        its own document and a document's last token predicts nothing, so the row computes what
        its documents would one at a time."""
        input_ids = check_input_ids(input_ids, self.config.vocab_size)
        document_ids = check_packed_input(input_ids, document_ids, caches)
        labels = checked_labels(labels, document_ids, self.config.vocab_size)
        empty = self.empty_output(input_ids, labels, loss_weights, return_logits)
        if empty is not None:
            return empty
        masks = {} if document_ids is None else {"document_ids": document_ids}
        if masks:
            check_takes_documents(self.blocks[0].attn, self.config.attention)
        h = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            # decoding caches are appended to in the forward: only a cacheless forward is checkpointed
            h = self.run_block(block, h, None, **masks) if caches is None else block(h, caches[i])
        if return_hidden:
            return CausalLMOutput(loss=None, logits=None, hidden=self.norm(h))
        logits, loss = self.logits_and_loss(h, labels, loss_weights, return_logits)
        return CausalLMOutput(loss=loss, logits=logits)

    def new_session(
        self, batch_size: int = 1, memory: str = "device", path: Any = None, block: int = 2048, kv_dtype: Any = None
    ) -> TransformerSession:
        """A decoding session over the attention kind's caches (KV, rolling KV or UQ-KV).

        block: prompt tokens per forward call (bounds the [block, context] attention scores of a
        long prompt). memory/path/kv_dtype select DRT's chunk memory and are accepted here only at
        their defaults, so that an evaluation can open any model's session the same way.
        """
        return TransformerSession(self, batch_size, memory, path, block, kv_dtype)


def refuse_chunk_memory(
    attention: str,
    memory: str,
    kv_dtype: Any,
    path: Any = None,
    names: str = "memory, path and kv_dtype",
    fix: str = "leave them unset",
) -> None:
    """Refuse DRT's chunk-memory options (a tier other than "device", a path, a K/V dtype) for a
    transformer of this `attention`, whose caches stay on the device in the model's dtype; `names`
    and `fix` say them as the caller's interface does (keywords, command-line flags)."""
    if memory != "device" or path is not None or kv_dtype is not None:
        raise InputError(
            f"{names} choose where a DRT keeps its chunk memory; this is a {attention!r} transformer, outside DRT's "
            f"chunk-memory tiers (its caches stay on the device in the model's dtype): {fix}"
        )


class TransformerSession(Session):
    """Feeds tokens through each layer's cache, `block` tokens per forward call."""

    def __init__(
        self, model: TransformerForCausalLM, batch_size: int, memory: str, path: Any, block: int, kv_dtype: Any
    ) -> None:
        refuse_chunk_memory(model.config.attention, memory, kv_dtype, path)
        if not isinstance(block, int) or block < 1:
            raise InputError(f"block must be an integer >= 1, got {block!r}")
        super().__init__(model, batch_size)
        self.caches = model.new_caches()
        self.block = block

    def _run(self, ids: torch.Tensor, every_position: bool) -> torch.Tensor:
        outputs = []
        for start in range(0, ids.shape[1], self.block):
            logits = self.model(ids[:, start : start + self.block], caches=self.caches).logits
            outputs.append(logits if every_position else logits[:, -1:])
        return torch.cat(outputs, dim=1) if every_position else outputs[-1]
