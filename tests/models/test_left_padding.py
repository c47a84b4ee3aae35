"""DRT prompts at any offset (docs/design.md §2.1): the session left-pads a prompt to a chunk boundary and
masks the padding out of the sliding window, the chunk encoder, retrieval and GCA, so the logits
of real tokens do not depend on the amount or the content of the padding."""

from pathlib import Path

import pytest
import torch

from farsight.data.tasks import RepeatedFiller, make_task
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError
from farsight.eval.needle import evaluate_needle_task
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM
from farsight.models.registry import load_model

V = 40
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-drt"


def tiny(groups=1, top_k=8, dtype=torch.float64, neighbors=(0, 0)):
    # top_k above the number of chunks: every earlier chunk is retrieved, the partly padded one
    # included, so a pad reaching GCA or a padding-only chunk competing in retrieval shows
    torch.manual_seed(0)
    cfg = DRTConfig(
        vocab_size=V,
        d_model=32,
        n_layers=4,
        n_heads=2,
        chunk_size=5,
        window=9,
        top_k=top_k,
        groups=groups,
        encoder_layers=1,
        neighbors_before=neighbors[0],
        neighbors_after=neighbors[1],
    )
    return DRTForCausalLM(cfg).to(dtype).eval()


def ids(b, n, seed=1):
    return torch.randint(0, V - 4, (b, n), generator=torch.Generator().manual_seed(seed))


def left_padded(prompt, pad, rows=2, seed=10):
    """prompt [1, T] behind `pad` junk tokens (different junk per row) -> ids [rows, pad + T], mask."""
    junk = torch.cat([ids(1, pad, seed=seed + r) for r in range(rows)])
    mask = torch.ones(rows, pad + prompt.shape[1], dtype=torch.long)
    mask[:, :pad] = 0
    return torch.cat([junk, prompt.expand(rows, -1)], 1), mask


def run(model, batch, answer, mask=None):
    """prefill, feed 7 answer tokens, step through 5 more -> (next, fed, steps) logits."""
    b = batch.shape[0]
    with model.new_session(batch_size=b) as session:
        first = session.prefill(batch, attention_mask=mask)
        fed = session.feed(answer[:, :7].expand(b, -1))
        steps = torch.stack([session.step(answer[:, i].expand(b)) for i in range(7, 12)], 1)
    return first, fed, steps


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("prompt_length", [1, 4, 5, 17, 23])
@pytest.mark.parametrize("neighbors", [(0, 0), (2, 1)])
def test_real_logits_do_not_depend_on_left_padding(groups, prompt_length, neighbors):
    # with one chunk retrieved and its neighbors, the first real chunk's neighbors before it are
    # padding-only chunks, which must never be read
    model = tiny(groups, top_k=1, neighbors=neighbors) if neighbors != (0, 0) else tiny(groups)
    prompt, answer = ids(1, prompt_length), ids(1, 12, seed=2)
    with model.new_session() as session:
        session.prefill(prompt)
        assert session.prompt_offset == -prompt_length % 5
    want = run(model, prompt, answer)
    # padding of part of a chunk, a chunk, more than two chunks; different junk in each row
    for pad in (3, 5, 11):
        batch, mask = left_padded(prompt, pad)
        for got, w in zip(run(model, batch, answer, mask), want):
            torch.testing.assert_close(got, w.expand_as(got), atol=1e-10, rtol=0)


def test_a_left_padded_batch_of_different_prompts_equals_each_alone():
    model = tiny(groups=2)
    long, short = ids(1, 17, seed=3), ids(1, 9, seed=4)
    batch = torch.cat([long, torch.cat([ids(1, 8, seed=5), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0
    answer = ids(1, 12, seed=2)
    got = run(model, batch, answer, mask)
    for row, prompt in enumerate((long, short)):
        for g, w in zip(got, run(model, prompt, answer)):
            torch.testing.assert_close(g[row], w[0], atol=1e-10, rtol=0)


def test_padding_masks_are_needed():
    # the tests above can fail: unmasked, the junk changes the logits
    model = tiny()
    prompt = ids(1, 17)
    batch, _ = left_padded(prompt, 5)
    with model.new_session(batch_size=2) as session:
        logits = session.prefill(batch)
    with model.new_session() as session:
        alone = session.prefill(prompt)
    assert (logits[0] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("groups", [1, 2])
def test_parallel_forward_masks_left_padding(groups):
    model = tiny(groups)
    x = ids(1, 31)
    alone = model(x).logits
    # paddings of whole chunks keep the real tokens on the same chunk grid
    for pad in (5, 10):
        batch, mask = left_padded(x, pad)
        full = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(full[:, pad:], alone.expand(2, -1, -1), atol=1e-10, rtol=0)
    # the streaming session agrees with the parallel forward on the padded layout
    batch, mask = left_padded(x, 3)  # 34 tokens: the session adds one alignment pad
    with model.new_session(batch_size=2) as session:
        last = session.prefill(batch, attention_mask=mask)
        assert session.prompt_offset == 1
    aligned = model(
        torch.cat([batch.new_zeros(2, 1), batch], 1), attention_mask=torch.cat([mask.new_zeros(2, 1), mask], 1)
    )
    torch.testing.assert_close(last, aligned.logits[:, -1], atol=1e-10, rtol=0)


@pytest.mark.parametrize("neighbors", [(0, 0), (3, 0)])
def test_padding_only_chunks_are_never_retrieved(neighbors):
    model = tiny(top_k=8 if neighbors == (0, 0) else 1, neighbors=neighbors)  # every candidate is read
    prompt = ids(1, 11)
    batch, mask = left_padded(prompt, 13)  # + 1 alignment pad: 2 chunks of padding and 4 pads more
    with model.new_session(batch_size=2, record_retrieval=True) as session:
        session.prefill(batch, attention_mask=mask)
        session.feed(ids(2, 10, seed=3))
        made = torch.cat(session.retrievals.indices, dim=1)  # [B, n, K], one group
        assert session.state.pad.tolist() == [2 * 6 + 4] * 2
    retrieved = made[made >= 0]
    assert retrieved.numel() and int(retrieved.min()) == 2


def test_low_precision_left_padding_stays_finite():
    model = tiny(dtype=torch.bfloat16)
    prompt = ids(1, 13)
    batch, mask = left_padded(prompt, 7)
    with model.new_session(batch_size=2) as session:
        logits = session.prefill(batch, attention_mask=mask)
        step = session.step(torch.tensor([1, 1]))
    with model.new_session() as session:
        alone = session.prefill(prompt)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()
    torch.testing.assert_close(logits.float(), alone.float().expand(2, -1), atol=0.05, rtol=0.05)


def test_iterable_prompts_align_with_their_length():
    model = tiny()
    prompt = ids(1, 23)
    with model.new_session() as session:
        want = session.prefill(prompt)
    with model.new_session() as session:
        got = session.prefill((prompt[:, i : i + 6] for i in range(0, 23, 6)), length=23)
        assert session.prompt_offset == 2
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    with model.new_session() as session, pytest.raises(InputError, match="told length=30 but the blocks held 23"):
        session.prefill(iter([prompt]), length=30)


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 1, 0, 1]], "must be left padding"),
        ([[1, 1, 1, 0]], "must be left padding"),
        ([[0, 2, 1, 1]], "0 \\(padding\\) and 1 \\(token\\) only"),
        ([[1, 1, 1]], "attention_mask has shape"),
    ],
)
def test_bad_attention_masks(mask, message):
    model = tiny()
    with model.new_session() as session, pytest.raises(InputError, match=message):
        session.prefill(ids(1, 4), attention_mask=torch.tensor(mask))
    with pytest.raises(InputError, match=message):
        model(ids(1, 4), attention_mask=torch.tensor(mask))


def test_models_without_padding_masks_refuse_padded_rows():
    cfg = TransformerConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, attention="causal")
    model = TransformerForCausalLM(cfg).eval()
    with (
        model.new_session(batch_size=2) as session,
        pytest.raises(InputError, match="feed each row in a session of its own"),
    ):
        session.prefill(ids(2, 4), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with model.new_session() as session:  # an all-ones mask is no padding
        session.prefill(ids(1, 4), attention_mask=torch.ones(1, 4))


def test_demo_model_answers_unaligned_passkeys():
    tok = load_tokenizer("byte")
    model = load_model(DEMO)
    task = make_task("passkey", tok, RepeatedFiller(tok), align=1)
    summary = evaluate_needle_task(model, task, [1024], [0.2, 0.7], trials=3, progress=False)
    row = summary["by_length"]["1024"]
    assert row["needle_retrieved"] == 1.0  # the needle's chunk is retrieved wherever the question falls
    assert row["exact_match"] >= 0.8


def test_left_padding_under_autocast_bf16():
    model = tiny(dtype=torch.float32)
    prompt = ids(1, 13)
    batch, mask = left_padded(prompt, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with model.new_session(batch_size=2) as session:
            logits = session.prefill(batch, attention_mask=mask)
        with model.new_session() as session:
            alone = session.prefill(prompt)
        full = model(batch, attention_mask=mask).logits
    assert torch.isfinite(logits).all() and torch.isfinite(full).all()
    torch.testing.assert_close(logits.float(), alone.float().expand(2, -1), atol=0.05, rtol=0.05)
