"""Causal retrieval (GCA, Hu et al. 2025) in a Llama-style decoder, with farsight.models.causal_retrieval.

Lower layers: plain Llama blocks (causal attention with RoPE, SwiGLU, RMSNorm: farsight's
TransformerBlock, attention="causal"); upper layers: the same blocks plus grouped cross-attention
over the past chunks that the previous chunk's landmark retrieved. `CausalRetrievalLM` adds the
rest: forward(input_ids, labels) -> loss and logits, and new_session(), which streams any length
with the chunk memory on the device, in RAM or on disk.

Run from the repository root: .venv/bin/python examples/llama_retrieval.py (trains a tiny model on
one batch for a few steps, then compares a session's logits over 32 chunks with the forward's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from farsight.layers import RMSNorm, TransformerBlock
from farsight.models import TransformerConfig
from farsight.models.causal_retrieval import CausalRetrievalLM, RetrievalBlock, check_retrieval_config
from farsight.models.transformer import init_weights


@dataclass
class LlamaRetrievalConfig(TransformerConfig):
    """A Llama decoder's sizes (attention="causal": RoPE) and the fields retrieval reads."""

    vocab_size: int = 64
    d_model: int = 64
    lower_layers: int | None = None  # None: n_layers // 2
    chunk_size: int = 8
    top_k: int = 2
    groups: int = 1
    encoder_layers: int = 1
    retriever: str = "learned"
    gumbel: bool = True
    gumbel_temperature: float = 1.0
    softmax_one: bool = True
    landmark_id: int | None = None  # None: the vocabulary's last id
    pad_id: int | None = None

    def validate(self) -> None:
        super().validate()  # the decoder's fields, then the retrieval's
        check_retrieval_config(self)


class LlamaWithRetrieval(CausalRetrievalLM):
    """The modules CausalRetrievalLM's docstring asks for, registered in its order."""

    def __init__(self, config: LlamaRetrievalConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.lower = nn.ModuleList(TransformerBlock(config) for _ in range(config.lower_layers))
        self.add_retrieval(config)  # chunk encoder, landmark keys, the groups' retrieval queries
        upper = range(config.n_layers - config.lower_layers)  # G groups, each retrieving on its own
        self.upper = nn.ModuleList(RetrievalBlock(config, config.softmax_one) for _ in upper)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.init_std, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight


def repeated_tokens(rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] random ids (never the landmark's) whose second half repeats the first."""
    return torch.randint(0, 60, (rows, length // 2), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)


def train(model: LlamaWithRetrieval, ids: torch.Tensor, steps: int) -> list[float]:
    """AdamW steps on one batch ids [B, L] (Gumbel noise picks the chunks); the loss of each."""
    optimizer = torch.optim.AdamW(model.train().parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def stream(model: LlamaWithRetrieval, ids: torch.Tensor, prompt: int, **options: str) -> torch.Tensor:
    """Logits [B, T - prompt + 1, V] after ids[:, prompt - 1 :]: prefill `prompt` tokens, feed the rest."""
    with model.new_session(ids.shape[0], **options) as session:
        return torch.cat([session.prefill(ids[:, :prompt])[:, None], session.feed(ids[:, prompt:])], dim=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = LlamaWithRetrieval(LlamaRetrievalConfig())
    losses = train(model, repeated_tokens(4, 64, seed=0), steps=20)
    print(f"training loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    ids = repeated_tokens(1, 256, seed=1)  # a prompt ending on a chunk boundary needs no alignment pads
    with torch.no_grad():
        difference = (stream(model.eval(), ids, 96, memory="disk") - model(ids).logits[:, 95:]).abs().max()
    print(f"session vs forward over 32 chunks (top 2 retrieved): max |logit difference| {difference:.1e}")
