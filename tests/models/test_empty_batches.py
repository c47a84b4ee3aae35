"""A batch without tokens ([B, 0] or [0, T] ids) gives logits [B, T, V] and, with labels, the loss
of no prediction (0, as when every label is ignored) for every model kind; a session refuses it."""

import pytest
import torch

from farsight.errors import InputError
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

SMALL = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
MODELS = {
    "causal": lambda: TransformerForCausalLM(TransformerConfig(**SMALL)),
    "sliding": lambda: TransformerForCausalLM(TransformerConfig(**SMALL, attention="sliding", window=8)),
    "castle": lambda: TransformerForCausalLM(TransformerConfig(**SMALL, attention="castle")),
    "castle-swl": lambda: TransformerForCausalLM(
        TransformerConfig(**SMALL, attention="castle-swl", lookahead_window=4)
    ),
    "drt": lambda: DRTForCausalLM(DRTConfig(**SMALL, chunk_size=4, window=8, top_k=2)),
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("shape", [(1, 0), (0, 6), (0, 0)])
def test_an_empty_batch_gives_empty_logits_and_a_zero_loss(kind, shape):
    model = MODELS[kind]()
    ids = torch.zeros(shape, dtype=torch.long)
    assert model(ids).logits.shape == (*shape, 260)
    out = model(ids, labels=ids)
    assert out.logits.shape == (*shape, 260) and out.loss.item() == 0.0
    loss = model(ids, labels=ids, return_logits=False).loss
    loss.backward()  # part of the graph, as a batch whose labels are all ignored
    assert loss.item() == 0.0


@pytest.mark.parametrize("kind", MODELS)
def test_a_session_refuses_an_empty_prompt(kind):
    model = MODELS[kind]().eval()
    with model.new_session(1) as session, pytest.raises(InputError, match="no tokens"):
        session.prefill(torch.zeros((1, 0), dtype=torch.long))
