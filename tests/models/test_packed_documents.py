"""Packed rows (document_ids): for every model kind, a row of several documents computes what its
documents compute one at a time — logits, the loss summed over their predictions and every
parameter's gradient (fp64) — and no document's outputs depend on another's tokens."""

import pytest
import torch

from farsight.errors import InputError, InputTypeError
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

SMALL = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
MODELS = {
    "causal": lambda: TransformerForCausalLM(TransformerConfig(**SMALL)),
    "sliding-alibi": lambda: TransformerForCausalLM(TransformerConfig(**SMALL, attention="sliding", window=6)),
    "sliding-rope": lambda: TransformerForCausalLM(
        TransformerConfig(**SMALL, attention="sliding", window=6, position="rope")
    ),
    "castle": lambda: TransformerForCausalLM(TransformerConfig(**SMALL, attention="castle")),
    "castle-swl": lambda: TransformerForCausalLM(
        TransformerConfig(**SMALL, attention="castle-swl", lookahead_window=3)
    ),
    "drt": lambda: DRTForCausalLM(DRTConfig(**SMALL, chunk_size=4, window=9, top_k=2)),
    "drt-neighbors": lambda: DRTForCausalLM(
        DRTConfig(**SMALL, chunk_size=3, window=7, top_k=1, neighbors_before=1, neighbors_after=2)
    ),
    "drt-x2-rope": lambda: DRTForCausalLM(
        DRTConfig(
            **{**SMALL, "n_layers": 3}, lower_layers=1, groups=2, chunk_size=3, window=7, top_k=2, position="rope"
        )
    ),
}
# two rows of 29 tokens: one-token documents, documents shorter and longer than a chunk and the window
LAYOUTS = ([5, 1, 14, 9], [29])


def packed_row(lengths, generator):
    ids = torch.randint(0, 250, (sum(lengths),), generator=generator)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids, documents


def make_model(kind):
    torch.manual_seed(0)
    return MODELS[kind]().double().eval()  # eval: a training DRT samples its retrieval


def loss_sum(model, ids, documents=None):
    """The summed next-token loss of rows [B, T] (the mean times its count of predictions)."""
    out = model(ids, labels=ids, document_ids=documents)
    count = (
        ids.shape[0] * (ids.shape[1] - 1) if documents is None else int((documents[:, 1:] == documents[:, :-1]).sum())
    )
    return out, out.loss * count


@pytest.mark.parametrize("kind", MODELS)
def test_a_packed_batch_equals_its_documents_one_at_a_time(kind):
    model = make_model(kind)
    generator = torch.Generator().manual_seed(1)
    rows = [packed_row(lengths, generator) for lengths in LAYOUTS]
    ids, documents = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    out, total = loss_sum(model, ids, documents)
    total.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone_total = 0.0
    for row, lengths in enumerate(LAYOUTS):
        start = 0
        for n in lengths:
            piece = ids[row : row + 1, start : start + n]
            alone, piece_total = loss_sum(model, piece)
            alone_total = alone_total + piece_total
            torch.testing.assert_close(out.logits[row, start : start + n], alone.logits[0], rtol=1e-10, atol=1e-10)
            start += n
    alone_total.backward()
    torch.testing.assert_close(total, alone_total, rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind", MODELS)
def test_changing_one_document_leaves_the_others_unchanged_bit_for_bit(kind):
    model = make_model(kind)
    ids, documents = packed_row(LAYOUTS[0], torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[6:20] = torch.randint(0, 250, (14,), generator=torch.Generator().manual_seed(3))  # the third document
    with torch.no_grad():
        before = model(ids[None], document_ids=documents[None]).logits[0]
        after = model(changed[None], document_ids=documents[None]).logits[0]
    others = documents != 2
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[~others], after[~others])


@pytest.mark.parametrize("precision", ["autocast", "pure"])
@pytest.mark.parametrize("kind", MODELS)
def test_packed_rows_in_bf16_follow_the_documents_alone(kind, precision):
    model = make_model(kind).float()
    ids, documents = packed_row(LAYOUTS[0], torch.Generator().manual_seed(4))
    with torch.no_grad():
        if precision == "pure":
            packed = model.to(torch.bfloat16)(ids[None], document_ids=documents[None]).logits[0].float()
            model.float()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                packed = model(ids[None], document_ids=documents[None]).logits[0].float()
    with torch.no_grad():
        start, alone = 0, []
        for n in LAYOUTS[0]:
            alone.append(model(ids[None, start : start + n]).logits[0])
            start += n
    expected = torch.cat(alone)
    error = (packed - expected).norm() / expected.norm()
    assert error < 0.02, f"bf16 packed logits differ from the fp32 documents by {error:.4f} (relative)"


@pytest.mark.parametrize("kind", MODELS)
def test_a_single_document_row_is_the_plain_forward(kind):
    model = make_model(kind)
    ids = torch.randint(0, 250, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(ids).logits
        packed = model(ids, document_ids=torch.zeros_like(ids)).logits
    torch.testing.assert_close(packed, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["causal", "drt"])
def test_an_empty_packed_batch_gives_empty_logits(kind):
    model = make_model(kind)
    ids = torch.zeros((2, 0), dtype=torch.long)
    out = model(ids, labels=ids, document_ids=torch.zeros_like(ids))
    assert out.logits.shape == (2, 0, 260) and out.loss.item() == 0.0


@pytest.mark.parametrize(
    ("documents", "error", "message"),
    [
        (torch.tensor([[0, 0, 1, 0]]), InputError, "decrease inside a row"),
        (torch.zeros(1, 3, dtype=torch.long), InputError, r"must have shape \[1, 4\]"),
        (torch.zeros(1, 4), InputTypeError, "must be an integer tensor"),
    ],
)
@pytest.mark.parametrize("kind", ["causal", "drt"])
def test_bad_document_ids_are_refused_in_one_line(kind, documents, error, message):
    model = make_model(kind)
    with pytest.raises(error, match=message) as caught:
        model(torch.tensor([[1, 2, 3, 4]]), document_ids=documents)
    assert "\n" not in str(caught.value)


def test_packed_rows_refuse_a_decoding_cache_and_left_padding():
    model = make_model("causal")
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(InputError, match="cannot be combined with decoding caches"):
        model(ids, caches=model.new_caches(), document_ids=torch.zeros_like(ids))
    drt = make_model("drt")
    with pytest.raises(InputError, match="document_ids or attention_mask, not both"):
        drt(ids, attention_mask=torch.ones_like(ids), document_ids=torch.zeros_like(ids))


def test_an_attention_kind_without_document_ids_is_refused_in_one_line():
    from torch import nn

    from farsight.layers import ATTENTION_KINDS, register_attention

    @register_attention("test-plain")
    class Plain(nn.Module):
        positions = ("none",)

        def __init__(self, config):
            super().__init__()
            self.proj = nn.Linear(config.d_model, config.d_model)

        def forward(self, x, cache=None):
            return self.proj(x)

    try:
        model = TransformerForCausalLM(TransformerConfig(**SMALL, attention="test-plain"))
        with pytest.raises(InputError, match="does not take document_ids"):
            model(torch.tensor([[1, 2]]), document_ids=torch.tensor([[0, 1]]))
    finally:
        del ATTENTION_KINDS["test-plain"]
