"""Activation checkpointing (PretrainedLM.set_activation_checkpointing): every block of every
model kind is recomputed in the backward, and the loss and every parameter's gradient are those
of the plain forward, in fp32 and in training mode (DRT's Gumbel noise and random retrieval on),
and within bf16's rounding under autocast and in pure bf16."""

import pytest
import torch

from farsight.models.drt import DRTConfig, DRTForCausalLM
from farsight.models.transformer import TransformerConfig, TransformerForCausalLM

V = 40

TRANSFORMERS = {
    "causal": {},
    "sliding": {"window": 8},
    "castle": {},
    "castle-swl": {"lookahead_window": 8},
}
DRTS = {
    "drt-gumbel": {"groups": 2},
    "drt-random": {"retriever": "random"},
    "drt-no-retrieval": {"retriever": "none"},
}


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind in TRANSFORMERS:
        config = TransformerConfig(
            vocab_size=V, d_model=32, n_layers=2, n_heads=2, attention=kind, **TRANSFORMERS[kind]
        )
        return TransformerForCausalLM(config)
    config = DRTConfig(
        vocab_size=V,
        d_model=32,
        n_layers=4,
        n_heads=2,
        chunk_size=5,
        window=12,
        top_k=2,
        encoder_layers=2,
        **DRTS[kind],
    )
    return DRTForCausalLM(config)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    if isinstance(model, DRTForCausalLM):
        return [*model.lower, *model.encoder, *model.upper]
    return list(model.blocks)


def loss_and_grads(model, ids, attention_mask=None):
    """(loss, {name: grad}, forward calls per block, the next random draws) of one seeded
    training forward + backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    calls = [0] * len(blocks(model))
    hooks = [
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(blocks(model))
    ]
    torch.manual_seed(123)  # the same Gumbel noise / random picks in both runs
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls, torch.rand(4)


@pytest.mark.parametrize("kind", [*TRANSFORMERS, *DRTS])
def test_checkpointed_loss_and_gradients_equal_the_plain_ones(kind):
    model = build(kind)
    ids = torch.randint(0, V - 4, (2, 31), generator=torch.Generator().manual_seed(1))
    plain_loss, plain_grads, plain_calls, plain_next = loss_and_grads(model, ids)
    model.set_activation_checkpointing(True)
    loss, grads, calls, next_draws = loss_and_grads(model, ids)
    # each block ran twice: in the forward and again, recomputed, in the backward
    # (without retrieval a DRT's chunk encoder does not run)
    used = [0 if kind == "drt-no-retrieval" and block in model.encoder else 1 for block in blocks(model)]
    assert plain_calls == used
    assert calls == [2 * n for n in used]
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    # the recomputation restored the RNG state it borrowed: the next step's Gumbel noise is the same
    assert torch.equal(next_draws, plain_next)
    assert grads.keys() == plain_grads.keys()
    if kind != "drt-no-retrieval":  # (which leaves the retrieval's parameters out)
        assert len(grads) == len(list(model.parameters()))  # every parameter is trained
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_checkpointed_drt_with_left_padding_equals_the_plain_forward():
    model = build("drt-gumbel")
    ids = torch.randint(0, V - 4, (2, 31), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1: 7 tokens of left padding (a whole chunk and two slots)
    plain_loss, plain_grads, _, _ = loss_and_grads(model, ids, mask)
    model.set_activation_checkpointing(True)
    loss, grads, calls, _ = loss_and_grads(model, ids, mask)
    assert calls == [2] * len(calls)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", ["sliding", "drt-gumbel"])
def test_forwards_without_gradients_or_in_eval_mode_are_not_recomputed(kind):
    model = build(kind).set_activation_checkpointing(True)
    ids = torch.randint(0, V - 4, (1, 13), generator=torch.Generator().manual_seed(4))
    calls = []
    for block in blocks(model):
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    model.train()
    with torch.no_grad():
        model(ids)
    model.eval()
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 2 * len(blocks(model))


@pytest.mark.parametrize("kind", list(TRANSFORMERS))
def test_a_forward_through_decoding_caches_is_not_checkpointed(kind):
    """A recomputation would append the tokens to the caches a second time."""
    checkpointed = []

    def spy(block, *args, **kwargs):
        checkpointed.append(block)
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, **kwargs)

    model = build(kind).set_activation_checkpointing(True, checkpoint_fn=spy).train()
    ids = torch.randint(0, V - 4, (1, 13), generator=torch.Generator().manual_seed(5))
    caches = model.new_caches()
    model(ids[:, :6], caches=caches)
    logits = model(ids[:, 6:], caches=caches).logits
    assert checkpointed == []
    torch.testing.assert_close(logits, model(ids).logits[:, 6:], rtol=1e-5, atol=1e-5)
    assert checkpointed == blocks(model)  # the cacheless forward is


def test_randomness_inside_a_block_is_replayed_in_the_recomputation():
    """A block that draws random numbers (here dropout after the MLP) draws the same ones again
    when recomputed: the checkpoint restores the forward's RNG state."""
    model = build("causal")
    for block in model.blocks:
        block.mlp = torch.nn.Sequential(block.mlp, torch.nn.Dropout(0.5))
    ids = torch.randint(0, V - 4, (2, 17), generator=torch.Generator().manual_seed(6))
    plain_loss, plain_grads, _, _ = loss_and_grads(model, ids)
    model.set_activation_checkpointing(True)
    loss, grads, calls, _ = loss_and_grads(model, ids)
    assert calls == [2] * len(calls)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize("precision", ["autocast-bf16", "bf16"])
@pytest.mark.parametrize("kind", ["sliding", "castle", "drt-gumbel"])
def test_checkpointed_low_precision_steps_equal_the_plain_ones(kind, precision):
    """Under bf16 autocast and with bf16 weights the recomputed blocks run in the same precision
    as the first forward: loss and gradients equal the plain step's within bf16's rounding."""
    model = build(kind)
    if precision == "bf16":
        model.to(torch.bfloat16)
    ids = torch.randint(0, V - 4, (2, 31), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast-bf16"):
            return loss_and_grads(model, ids)

    plain_loss, plain_grads, _, _ = step()
    model.set_activation_checkpointing(True)
    loss, grads, calls, _ = step()
    assert all(n == 2 for n in calls)
    torch.testing.assert_close(loss.float(), plain_loss.float(), rtol=2e-2, atol=1e-3)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == plain_grads[name].dtype, name
        torch.testing.assert_close(grad.float(), plain_grads[name].float(), rtol=5e-2, atol=5e-3, msg=name)
