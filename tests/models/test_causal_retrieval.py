"""The causal-retrieval component (farsight.models.causal_retrieval) on a backbone of its user's:
examples/llama_retrieval.py's Llama decoder trains, and its session streams what its parallel
forward computes with retrieval choosing among more chunks than it keeps; DRT is the same class."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from farsight.models import DRTForCausalLM, DRTSession
from farsight.models.causal_retrieval import CausalRetrievalLM

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_retrieval.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("llama_retrieval", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass resolves its annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def llama(example, **config):
    torch.manual_seed(0)
    return example.LlamaWithRetrieval(example.LlamaRetrievalConfig(**config))


def test_the_example_stays_under_100_lines():
    assert len(EXAMPLE.read_text().splitlines()) < 100


def test_drt_and_the_example_are_built_from_the_component(example):
    model = llama(example)
    assert isinstance(model, CausalRetrievalLM) and issubclass(DRTForCausalLM, CausalRetrievalLM)
    with model.new_session() as session:
        assert type(session) is DRTSession  # the one session, not a copy
    assert [type(block.attn).__name__ for block in model.layers()] == ["CausalSelfAttention"] * 4


def test_the_example_trains(example):
    model = llama(example)
    losses = example.train(model, example.repeated_tokens(4, 64, seed=0), steps=10)
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.query_proj[0].weight.grad.abs().sum() > 0  # the retrieval scores are learned


@pytest.mark.parametrize("fill", [0, 7])
def test_left_padding_reaches_no_real_token(example, fill):
    """A chunk of left padding (of any content) changes nothing: the causal attention hides it as
    the chunk encoder, retrieval and GCA do, and RoPE only sees distances."""
    model = llama(example).double().eval()
    ids = example.repeated_tokens(2, 68, seed=3)
    mask = torch.ones(2, 68, dtype=torch.long)
    mask[0, :8] = 0  # row 0: 60 tokens after a chunk of padding, row 1: 68 tokens
    padded = torch.stack([torch.cat([ids.new_full((8,), fill), ids[0, :60]]), ids[1]])
    got = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(got[0, 8:], model(ids[:1, :60]).logits[0], rtol=0, atol=1e-12)


def padded_forward(model, ids, prompt):
    """The parallel forward over what a session streams after prefill(ids[:, :prompt]): the
    session puts -prompt % S masked pads in front so that the prompt ends on a chunk boundary."""
    pads = -prompt % model.config.chunk_size
    mask = torch.ones(ids.shape[0], pads + ids.shape[1], dtype=torch.long)
    mask[:, :pads] = 0
    return model(torch.cat([ids.new_zeros(ids.shape[0], pads), ids], 1), attention_mask=mask).logits[:, pads:]


@pytest.mark.parametrize(
    ("prompt", "memory", "segment_chunks"), [(96, "disk", 64), (101, "device", 3), (13, "host", 2)]
)
def test_a_session_streams_the_parallel_forward_while_retrieval_chooses(example, prompt, memory, segment_chunks):
    model = llama(example, groups=2).double().eval()
    ids = example.repeated_tokens(2, 200, seed=1)  # 25 chunks, top 2 of up to 24 earlier ones
    want = padded_forward(model, ids, prompt)
    if prompt % model.config.chunk_size == 0:  # no alignment pads: the plain forward
        torch.testing.assert_close(want, model(ids).logits, rtol=0, atol=1e-12)
    with model.new_session(2, memory=memory, segment_chunks=segment_chunks, record_retrieval=True) as session:
        got = [session.prefill(ids[:, :prompt])[:, None], session.feed(ids[:, prompt:150])]
        got += [session.step(ids[:, i])[:, None] for i in range(150, 200)]
        made = torch.cat(session.retrievals.indices[::2], dim=1)  # group 0's, one block per span
    torch.testing.assert_close(torch.cat(got, 1), want[:, prompt - 1 :], rtol=0, atol=1e-10)
    later = made[:, -5:]  # chunks with far more candidates than top_k: every slot filled, none alike
    assert bool((later >= 0).all()) and bool((later[..., 0] != later[..., 1]).all())


def test_a_session_rewinds_the_full_attention_caches(example):
    """score_each scores each continuation from the same point: the Llama blocks' growing KV
    caches go back to their length at the mark although their buffers were appended to."""
    model = llama(example).double()
    ids = example.repeated_tokens(1, 120, seed=2)
    alternatives = [ids[:, 100:110], ids[:, 110:120], ids[:, 100:110]]
    with model.new_session() as session:
        session.prefill(ids[:, :100])
        scores = session.score_each(alternatives)
    for ids_after, score in zip(alternatives, scores):
        with model.new_session() as session:
            session.prefill(ids[:, :100])
            torch.testing.assert_close(score.logprobs, session.score(ids_after), rtol=0, atol=1e-12)
