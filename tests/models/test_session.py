"""The Session protocol, the same for every LM kind: prefill + steps == the parallel forward,
score == log-softmax of the forward, one generate code path, and DRT fetching retrieved chunks
once per chunk."""

from types import SimpleNamespace

import pytest
import torch

import farsight.models.session as session_module
from farsight.errors import InputError, StateError
from farsight.models import DRTConfig, DRTForCausalLM, Session, TransformerConfig, TransformerForCausalLM

V = 40


def make(kind):
    torch.manual_seed(0)
    if kind == "drt":
        cfg = DRTConfig(
            vocab_size=V,
            d_model=32,
            n_layers=4,
            n_heads=2,
            chunk_size=5,
            window=12,
            top_k=2,
            groups=2,
            encoder_layers=1,
        )
        return DRTForCausalLM(cfg).double().eval()
    extra = {"sliding": {"window": 6}, "castle-swl": {"lookahead_window": 5}}.get(kind, {})
    cfg = TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attention=kind, **extra)
    return TransformerForCausalLM(cfg).double().eval()


KINDS = ["causal", "sliding", "castle", "castle-swl", "drt"]


def ids(b, n, seed=1):
    return torch.randint(0, V - 4, (b, n), generator=torch.Generator().manual_seed(seed))


def streamed_forward(model, x, prompt):
    """The parallel forward over what a session streams after prefill(x[:, :prompt]): DRT puts
    -prompt % S masked pads in front so that the prompt ends on a chunk boundary."""
    if not isinstance(model, DRTForCausalLM):
        return model(x).logits
    pads = -prompt % model.config.chunk_size
    mask = torch.ones(x.shape[0], pads + x.shape[1], dtype=torch.long)
    mask[:, :pads] = 0
    return model(torch.cat([x.new_zeros(x.shape[0], pads), x], 1), attention_mask=mask).logits[:, pads:]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_feed_and_steps_equal_the_parallel_forward(kind):
    model = make(kind)
    x = ids(2, 29)
    full = streamed_forward(model, x, 7)
    with model.new_session(batch_size=2) as session:
        assert isinstance(session, Session)
        first = session.prefill(x[:, :7])
        fed = session.feed(x[:, 7:13])
        steps = [session.step(x[:, i]) for i in range(13, 29)]
        assert session.tokens_seen == 29
    torch.testing.assert_close(first, full[:, 6])
    torch.testing.assert_close(fed, full[:, 7:13])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 13:])


@pytest.mark.parametrize("kind", KINDS)
def test_score_is_the_log_probability_of_the_continuation(kind):
    model = make(kind)
    x = ids(2, 23)
    want = streamed_forward(model, x, 9).log_softmax(-1)[:, 8:-1].gather(-1, x[:, 9:, None]).squeeze(-1)
    with model.new_session(batch_size=2) as session:
        with pytest.raises(InputError, match="prefill at least one token"):
            session.score(x[:, :3])
        session.prefill(x[:, :9])
        got = session.score(x[:, 9:])
    assert got.shape == (2, 14) and got.dtype == torch.float64
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_is_one_code_path_for_every_model(kind, monkeypatch):
    model = make(kind)
    calls = []
    real = session_module.generate

    def spy(session, *args, **kwargs):
        calls.append(type(session).__name__)
        return real(session, *args, **kwargs)

    monkeypatch.setattr(session_module, "generate", spy)
    prompt = ids(1, 12)
    out = model.generate(prompt, 6, temperature=0)
    assert len(calls) == 1 and out.shape == (1, 18)
    # greedy: every new token is the argmax of the parallel forward over what came before
    assert torch.equal(streamed_forward(model, out, 12)[:, 11:-1].argmax(-1), out[:, 12:])


@pytest.mark.parametrize("kind", ["causal", "drt"])
def test_session_errors_and_mode(kind):
    model = make(kind).train()
    session = model.new_session(batch_size=2)
    assert not model.training  # sessions decode in eval mode
    with pytest.raises(InputError, match="batch_size=2"):
        session.prefill(ids(3, 4))
    with pytest.raises(InputError, match="no tokens"):
        session.prefill(ids(2, 0))
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        session.prefill(torch.full((2, 3), V))
    session.close()
    assert model.training  # the caller's mode is back
    with pytest.raises(StateError, match="closed"):
        session.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="batch_size"):
        model.new_session(batch_size=0)


def test_transformer_session_refuses_a_chunk_memory_tier():
    with pytest.raises(InputError, match="DRT's chunk-memory tier"):
        make("causal").new_session(memory="disk")


@pytest.mark.parametrize("memory", ["device", "host", "disk"])
def test_drt_decode_fetches_retrieved_chunks_once_per_chunk(memory):
    model = make("drt")
    s, groups = model.config.chunk_size, model.config.groups
    x = ids(1, 61)
    full = streamed_forward(model, x, 13)
    with model.new_session(memory=memory) as session:
        store = session.memory.store
        gathers = []
        real = store.gather

        def counting(index):
            gathers[-1] += 1
            return real(index)

        store.gather = counting
        gathers.append(0)
        session.prefill(x[:, :13])
        logits = []
        for i in range(13, 61):
            gathers.append(0)
            logits.append(session.step(x[:, i]))
    torch.testing.assert_close(torch.stack(logits, 1), full[:, 13:])
    steps = gathers[1:]
    # token i is the first of its chunk when (i + pads) % s == 0: the retrieval changed, each group reads once
    pads = session.prompt_offset
    assert pads == -13 % s
    for i, count in zip(range(13, 61), steps):
        assert count == (groups if (i + pads) % s == 0 else 0), (i, steps)


class ScriptedSession:
    """Stands in for a session: its logits put all mass on the next token of a script per row."""

    def __init__(self, script, unsampled=()):
        self.script, self.t = torch.tensor(script), 0
        self.model = SimpleNamespace(reserved_ids=lambda: {f"reserved {i}": token for i, token in enumerate(unsampled)})

    def _logits(self):
        return torch.nn.functional.one_hot(self.script[:, self.t], V).double() * 50

    def prefill(self, ids, attention_mask=None):
        return self._logits()

    def step(self, token):
        self.t += 1
        return self._logits()


def test_generate_stops_rows_at_any_of_several_eos_ids_and_pads_after():
    from farsight.models.generation import generate

    script = [[5, 9, 7, 7, 7], [5, 6, 8, 3, 3], [1, 2, 3, 4, 5]]
    prompt = torch.zeros(3, 2, dtype=torch.long)
    out = generate(ScriptedSession(script), prompt, 4, temperature=0, eos_token_id=[9, 8], pad_token_id=0)
    assert out[:, 2:].tolist() == [[5, 9, 0, 0], [5, 6, 8, 0], [1, 2, 3, 4]]
    # one eos id, no pad id: finished rows repeat eos, and the loop stops once every row ended
    out = generate(ScriptedSession(script[:2]), prompt[:2], 5, temperature=0, eos_token_id=8)
    assert out[:, 2:].tolist() == [[5, 9, 7, 7, 7], [5, 6, 8, 8, 8]]
    out = generate(ScriptedSession([[9, 1, 1], [8, 1, 1]]), prompt[:2], 3, temperature=0, eos_token_id=[8, 9])
    assert out.shape == (2, 3)


def test_on_token_sees_each_new_token_and_ends_the_rows_it_returns():
    from farsight.models.generation import generate

    script = [[5, 9, 7, 7, 7], [5, 6, 8, 3, 3], [1, 2, 3, 4, 5]]
    prompt = torch.zeros(3, 2, dtype=torch.long)
    seen = []

    def on_token(token):  # ends row 2 once it has 2 new tokens, as a stopping criterion would
        seen.append(token.tolist())
        return torch.tensor([False, False, len(seen) >= 2])

    out = generate(ScriptedSession(script), prompt, 4, temperature=0, eos_token_id=9, pad_token_id=0, on_token=on_token)
    assert out[:, 2:].tolist() == [[5, 9, 0, 0], [5, 6, 8, 3], [1, 2, 0, 0]]
    assert seen == out[:, 2:].t().tolist()  # the tokens as returned, pads included
    with pytest.raises(InputError, match="pad_token_id"):  # an ended row needs something to continue with
        generate(
            ScriptedSession(script), prompt, 4, temperature=0, on_token=lambda token: torch.ones(3, dtype=torch.bool)
        )


def test_generate_never_samples_an_id_the_model_refuses_as_input():
    from farsight.models.generation import generate

    out = generate(ScriptedSession([[9, 9, 9]], unsampled=[9]), torch.zeros(1, 1, dtype=torch.long), 3, temperature=0)
    assert 9 not in out[0, 1:].tolist()
    # a DRT whose head favours its landmark id: sampling it would make the next step fail
    model = make("drt")
    lmk = model.config.landmark_id
    model.lm_head.register_forward_hook(lambda module, inputs, out: out.index_fill(-1, torch.tensor([lmk]), 1e4))
    assert model(ids(1, 9)).logits[0, -1].argmax() == lmk
    for temperature in (0.0, 1.0):
        out = model.generate(ids(1, 9), 12, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert out.shape == (1, 21) and lmk not in out[0, 9:].tolist()


def test_score_each_rewinds_between_alternatives():
    model = make("drt")
    context, alternatives = ids(2, 23), [ids(2, 4, seed=s) for s in (5, 6, 7)] + [ids(2, 11, seed=8)]
    with model.new_session(batch_size=2) as session:
        session.prefill(context)
        got = session.score_each(alternatives)
        after = session.step(alternatives[0][:, 0])  # the session is where it was before score_each
    for ids_, score in zip(alternatives, got):
        with model.new_session(batch_size=2) as alone:
            first = alone.prefill(context)
            logits = alone.feed(ids_)
        predicted = torch.cat([first[:, None], logits[:, :-1]], 1)
        want = predicted.log_softmax(-1).gather(-1, ids_[..., None]).squeeze(-1)
        torch.testing.assert_close(score.logprobs, want, atol=1e-12, rtol=0)
        assert torch.equal(score.greedy, predicted.argmax(-1) == ids_)
    with model.new_session(batch_size=2) as alone:
        alone.prefill(context)
        torch.testing.assert_close(after, alone.step(alternatives[0][:, 0]), atol=1e-12, rtol=0)


def test_score_each_needs_a_session_that_rewinds():
    model = make("causal")
    with model.new_session() as session, pytest.raises(StateError, match="cannot rewind"):
        session.prefill(ids(1, 5))
        session.score_each([ids(1, 2)])
