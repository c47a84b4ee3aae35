import re
from pathlib import Path

import numpy as np
import pytest
import torch

from farsight.config import ConfigError
from farsight.data.tasks import CorpusFiller, RepeatedFiller, make_task
from farsight.data.tasks.ruler import RULER_TASKS, make_ruler_tasks
from farsight.data.tasks.training import NeedleBatchConfig, NeedleBatches
from farsight.data.token_files import prepare_corpus
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError

TOK = load_tokenizer("byte")


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("task", ["passkey", "multikey", "niah2hop"])
@pytest.mark.parametrize("length", [256, 257, 1000, 4096 + 5])
@pytest.mark.parametrize("align", [1, 32, 64])
def test_exact_length_and_chunk_aligned_answer(task, length, align):
    t = make_task(task, TOK, RepeatedFiller(TOK), align)
    s = t.sample(length, 0.5, rng())
    assert len(s.input_ids) == length  # exact to the token
    is_len = len(TOK.encode(" is"))
    # the chunk that holds the answer starts right at " is": its landmark saw the whole question
    assert (s.answer_start - is_len) % align == 0
    assert TOK.decode(s.input_ids[s.answer_start - is_len : s.answer_start].tolist()) == " is"
    assert s.answer_start + s.answer_length <= length


def test_passkey_text_and_answer():
    s = make_task("passkey", TOK, RepeatedFiller(TOK), 32).sample(512, 0.25, rng(3))
    key = s.info["passkey"]
    text = TOK.decode(s.input_ids.tolist())
    assert f"The passkey is: {key}." in text
    assert TOK.decode(s.prompt.tolist()).endswith("What is the passkey? The passkey is")
    assert TOK.decode(s.answer.tolist()) == f" {key}"
    assert (
        s.answer_lead == 1 and TOK.decode(s.answer[s.answer_lead :].tolist()) == key
    )  # first-token scoring starts at the digits
    needle = TOK.decode(s.input_ids[s.needle_positions[0] : s.needle_positions[0] + s.needle_lengths[0]].tolist())
    assert key in needle


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_depth_places_the_needle(depth):
    s = make_task("passkey", TOK, RepeatedFiller(TOK), 1).sample(2000, depth, rng())
    haystack = s.answer_start - 100
    assert abs(s.needle_positions[0] - depth * haystack) < 60


@pytest.mark.parametrize("shift", [-7, 5])
def test_a_needle_shift_moves_the_asked_needle_and_nothing_else(shift):
    task = make_task("passkey", TOK, CorpusFiller(np.arange(10_000) % 250), 32)
    plain, moved = task.sample(2000, 0.5, rng(4)), task.sample(2000, 0.5, rng(4), needle_shift=shift)

    def without_needle(s):
        start, n = s.needle_positions[0], s.needle_lengths[0]
        return np.concatenate([s.input_ids[:start], s.input_ids[start + n :]])

    assert moved.needle_positions[0] == plain.needle_positions[0] + shift
    assert np.array_equal(without_needle(moved), without_needle(plain)) and moved.info == plain.info
    assert moved.answer_start == plain.answer_start
    # kept inside the haystack: a needle at either end cannot move past it
    assert task.sample(2000, 0.0, rng(4), needle_shift=-3).needle_positions[0] == 0
    end = task.sample(2000, 1.0, rng(4))
    assert task.sample(2000, 1.0, rng(4), needle_shift=40).needle_positions[0] == end.needle_positions[0]


def test_determinism_from_the_seed():
    t = make_task("niah2hop", TOK, CorpusFiller(np.arange(10_000) % 250), 32)
    a, b = t.sample(3000, 0.3, rng(7)), t.sample(3000, 0.3, rng(7))
    c = t.sample(3000, 0.3, rng(8))
    assert np.array_equal(a.input_ids, b.input_ids) and not np.array_equal(a.input_ids, c.input_ids)


def test_two_hop_chain_and_distractors():
    s = make_task("niah2hop", TOK, RepeatedFiller(TOK), 16, distractors=3).sample(4000, 0.5, rng(1))
    a, b, c = s.info["path"]
    text = TOK.decode(s.input_ids.tolist())
    assert f"DEF {a}->{b}." in text and f"DEF {b}->{c}." in text
    assert text.count("DEF ") == 2 * 4
    assert TOK.decode(s.answer.tolist()) == f": {b}, {c}"
    # first-token accuracy is scored on the first letter of b, not on the ": " every model gets right
    assert TOK.decode(s.answer[s.answer_lead :].tolist()) == f"{b}, {c}"
    assert TOK.decode(s.prompt.tolist()).endswith(f"The path from {a} is")


def test_multikey_asks_one_of_several():
    s = make_task("multikey", TOK, RepeatedFiller(TOK), 8, keys=3).sample(1500, 0.5, rng(2))
    text = TOK.decode(s.input_ids.tolist())
    assert text.count("The pass key of ") == 3 + 1  # three needles and the question
    assert f"The pass key of {s.info['key']} is: {s.info['passkey']}." in text


def test_corpus_filler_serves_lengths_beyond_the_corpus_and_drops_specials():
    tokens = np.array([1, 2, 258, 3, 4, 5, 6, 7] * 10)
    f = CorpusFiller(tokens, drop_ids=(258,))
    out = f.take(5000, rng())
    assert len(out) == 5000 and 258 not in out


def test_sixteen_million_tokens_without_strings():
    t = make_task("passkey", TOK, CorpusFiller(np.arange(100_000) % 250), 64)
    s = t.sample(16 * 2**20, 0.5, rng())
    assert len(s.input_ids) == 16 * 2**20 and s.input_ids.dtype == np.int64


def test_too_short_is_a_clear_error():
    with pytest.raises(ValueError, match="too short"):
        make_task("niah2hop", TOK, RepeatedFiller(TOK), 64).sample(64, 0.5, rng())
    with pytest.raises(ValueError, match="unknown task"):
        make_task("haystack", TOK, RepeatedFiller(TOK))


@pytest.mark.parametrize("align", [1, 3, 32])
def test_too_short_states_the_exact_minimum_for_the_shift_of_the_question(align):
    """The stated minimum is the shortest length that fits the same shift and alignment."""
    task = make_task("passkey", TOK, RepeatedFiller(TOK), align)
    for shift in (0, 16):
        shortest = next(n for n in range(8, 400) if _fits(task, n, shift))
        with pytest.raises(
            InputError, match="question 16 tokens earlier" if shift else "tokens; raise --lengths$"
        ) as error:
            task.sample(shortest - 1, 0.5, rng(), shift=shift)
        assert int(re.search(r"at least (\d+) tokens", str(error.value)).group(1)) == shortest


def _fits(task, length, shift):
    try:
        task.sample(length, 0.5, rng(), shift=shift)
    except InputError as error:
        assert "too short" in str(error)
        return False
    return True


def test_training_batches_follow_the_curriculum_and_weight_answers():
    cfg = NeedleBatchConfig(
        filler="repeat", seq_len=256, batch_tokens=1024, curriculum=[[0, 128], [10, 256]], answer_weight=10.0
    )
    source = NeedleBatches(cfg, seed=0, model={"chunk_size": 16})
    early, late = source.train_batch(0, 0, 0), source.train_batch(10, 0, 0)
    assert early["input_ids"].shape == (8, 128) and late["input_ids"].shape == (4, 256)
    assert torch.equal(source.train_batch(3, 0, 0)["input_ids"], source.train_batch(3, 0, 0)["input_ids"])
    weights = early["loss_weights"]
    assert set(weights.unique().tolist()) == {1.0, 10.0} and int((weights == 10).sum(1)[0]) == 6
    assert source.eval_batch(0)["input_ids"].shape[1] == 256


@pytest.mark.parametrize("task", ["passkey", "multikey", "niah2hop", "niah_multikey_1"])
def test_needle_weight_covers_the_needles_and_the_question_not_the_haystack(task):
    if task in RULER_TASKS:
        made = make_ruler_tasks([task], TOK, 1, haystack="noise")[0]
    else:
        made = make_task(task, TOK, RepeatedFiller(TOK), 1)
    sample = made.sample(1500, 0.3, rng(2))
    weights = sample.loss_weights(answer_weight=10.0, needle_weight=0.0)
    text = lambda mask: TOK.decode(sample.input_ids[mask].tolist())  # noqa: E731
    start, end = sample.answer_start, sample.answer_start + sample.answer_length
    assert (weights[start:end] == 10).all() and text(weights == 10) == TOK.decode(sample.answer.tolist())
    for position, length in zip(sample.needle_positions, sample.needle_lengths):
        assert (weights[position : position + length] == 0).all()
    # the question up to the answer is weighted 0 too: the text that asks, whole
    question = TOK.decode(sample.input_ids[sample.question_start : start].tolist())
    assert (weights[sample.question_start : start] == 0).all() and question.endswith(" is")
    assert question.lstrip().startswith(("What", "The path", "Question:")), question
    assert weights[end:].min() == 1
    zero = int((weights == 0).sum())
    assert zero == sum(sample.needle_lengths) + start - sample.question_start
    assert np.array_equal(sample.loss_weights(10.0), np.where(weights == 10, 10.0, 1.0).astype(np.float32))


def test_training_batches_weight_needles_as_configured():
    cfg = NeedleBatchConfig(filler="repeat", seq_len=256, batch_tokens=1024, answer_weight=10.0, needle_weight=0.0)
    weights = NeedleBatches(cfg, seed=0, model={"chunk_size": 16}).train_batch(0, 0, 0)["loss_weights"]
    assert set(weights.unique().tolist()) == {0.0, 1.0, 10.0}
    assert "needles and questions weighted 0x" in cfg.describe()
    with pytest.raises(Exception, match="data.needle_weight must be >= 0"):
        NeedleBatchConfig(filler="repeat", needle_weight=-1.0).validate()


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_a_near_question_share_puts_that_share_of_needles_right_before_the_question(monkeypatch, share):
    cfg = NeedleBatchConfig(filler="repeat", seq_len=256, batch_tokens=256 * 64, near_question=share)
    source = NeedleBatches(cfg, seed=0, model={"chunk_size": 16})
    task = source.tasks["train"][0]
    depths, sample = [], task.sample
    monkeypatch.setattr(
        task, "sample", lambda length, depth, *args: depths.append(depth) or sample(length, depth, *args)
    )
    for step in range(8):
        source.train_batch(step, 0, 0)
    near = depths.count(1.0) / len(depths)
    assert len(depths) == 8 * 64 and (0.18 < near < 0.32 if share else near == 0)
    assert ("25% of the needles right before the question" in cfg.describe()) == bool(share)
    with pytest.raises(ConfigError, match=r"data.near_question must be in \[0, 1\], got 1.5"):
        NeedleBatchConfig.from_dict({"filler": "repeat", "near_question": 1.5}, "data")


def test_a_config_without_a_near_question_share_draws_the_batches_it_drew_before_the_share_existed():
    """The share draws from the row's generator only when set, so runs of older configs resume
    on the very batches they started with (the digest: the batch as drawn before the option)."""
    import hashlib

    cfg = NeedleBatchConfig(filler="repeat", seq_len=512, batch_tokens=2048, mix={"passkey": 1, "niah_single_1": 1})
    batch = NeedleBatches(cfg, seed=0, model={"chunk_size": 16}).train_batch(3, 0, 0)
    digest = hashlib.sha256(batch["input_ids"].numpy().tobytes() + batch["loss_weights"].numpy().tobytes())
    assert digest.hexdigest() == "0afaa62f8e1117fa8cf383a6c9e357689899fe5350078bfe818c1950ceb58ef3"


BAD_NEEDLE_DATA = [
    ({"curriculum": "abc"}, "list of [step, length] pairs of integers"),
    ({"curriculum": [1, 2]}, "list of [step, length] pairs of integers"),
    ({"curriculum": [[0, "x"]]}, "list of [step, length] pairs of integers"),
    ({"curriculum": [[0, 128, 3]]}, "list of [step, length] pairs of integers"),
    ({"curriculum": 5}, "list of [step, length] pairs of integers"),
    ({"curriculum": []}, "list of [step, length] pairs of integers"),
    ({"curriculum": [[10, 128]]}, "increasing steps"),
    ({"curriculum": [[0, 8]]}, "lengths must be in [16, seq_len]"),
    ({"task_options": "abc"}, "data.task_options must map a task name to its options"),
    ({"task_options": {"digits": 5}}, "data.task_options must map a task name to its options"),
    ({"task_options": {"multikey": {"keys": 2}}}, "names 'multikey', which this run does not train; it trains passkey"),
]


@pytest.mark.parametrize("change, message", BAD_NEEDLE_DATA, ids=[str(c) for c, _ in BAD_NEEDLE_DATA])
def test_malformed_needle_data_is_refused_with_its_shape(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        NeedleBatchConfig.from_dict({"filler": "repeat", "seq_len": 256, **change}, "data")


def test_needle_batches_name_a_bad_chunk_size_as_the_models():
    with pytest.raises(ConfigError, match=r"model.chunk_size must be an integer >= 1, got 0"):
        NeedleBatches(NeedleBatchConfig(filler="repeat", seq_len=256), seed=0, model={"chunk_size": 0})


@pytest.mark.parametrize("align, offsets", [(None, {0}), (32, {0}), (8, {0, 8, 16, 24}), (1, set(range(32)))])
def test_training_questions_end_at_every_offset_that_align_allows(align, offsets):
    """The question's end (where " is" and the answer start) falls at each multiple of `align`
    within a 32-token chunk across the batches, not at one offset set by the length."""
    cfg = NeedleBatchConfig(filler="repeat", seq_len=256, batch_tokens=256 * 64, answer_weight=10.0, align=align)
    source = NeedleBatches(cfg, seed=0, model={"chunk_size": 32})
    seen = set()
    for step in range(4):
        weights = source.train_batch(step, 0, 0)["loss_weights"]
        first_answer = (weights == 10).float().argmax(1)  # [rows]: the answer's first token
        seen |= {int(i) % 32 for i in first_answer - len(TOK.encode(" is"))}
    assert seen == offsets
    with pytest.raises(Exception, match="shift must be >= 0"):
        make_task("passkey", TOK, RepeatedFiller(TOK), 1).sample(256, 0.5, rng(), shift=-1)


@pytest.mark.parametrize("task", ["passkey", "multikey", "niah2hop"])
def test_evidence_spans_point_at_what_the_answer_copies(task):
    s = make_task(task, TOK, RepeatedFiller(TOK), 32).sample(3000, 0.4, rng(5))
    texts = [TOK.decode(s.input_ids[a : a + n].tolist()) for a, n in s.evidence]
    if task == "niah2hop":
        a, b, c = s.info["path"]
        assert texts == [f" DEF {a}->{b}.", f" DEF {b}->{c}."]
    else:
        assert texts == [" " + s.info["passkey"]]
    assert s.evidence_chunks(32) == {p // 32 for a, n in s.evidence for p in range(a, a + n)}


def test_training_mixes_ruler_tasks_with_the_passkey_tasks(tmp_path):
    cfg = NeedleBatchConfig.from_dict(
        {
            "filler": "repeat",
            "seq_len": 1024,
            "batch_tokens": 1024 * 12,
            "mix": {"passkey": 1, "niah_multikey_2": 1, "vt": 1},
            "task_options": {"vt": {"wording": "varied", "hops": 2}},
        },
        "data",
    )
    source = NeedleBatches(cfg, seed=0, model={"chunk_size": 16})
    assert [t.name for t in source.tasks["train"]] == ["passkey", "niah_multikey_2", "vt"]
    assert source.tasks["train"][2].wording == "varied" and source.tasks["train"][2].hops == 2
    assert "needle tasks (passkey 1, niah_multikey_2 1, vt 1; vt wording=varied, hops=2)" in cfg.describe()
    assert "RULER-style tasks: RULER's haystack for each" in cfg.describe()
    batch = source.train_batch(0, 0, 0)
    assert batch["input_ids"].shape == (12, 1024)
    texts = [TOK.decode(row.tolist()) for row in batch["input_ids"]]
    assert any("The passkey is" in t for t in texts) and any("special magic" in t for t in texts)
    for row, weights in zip(batch["input_ids"], batch["loss_weights"]):
        answer = TOK.decode(row[weights == 10].tolist())  # every row asks something, answered in the loss
        assert answer.strip()
    # a task that reads real text needs the corpus; an unknown name lists every task
    with pytest.raises(ConfigError, match="niah_single_2 reads real text.*set data.corpus"):
        NeedleBatchConfig.from_dict({"filler": "repeat", "mix": {"niah_single_2": 1}}, "data")
    with pytest.raises(ConfigError, match="data.task 'niah' is unknown; choose from passkey, .*niah_single_1, .*fwe"):
        NeedleBatchConfig.from_dict({"filler": "repeat", "task": "niah"}, "data")
    # the noise tasks share the repeated-text filler of the passkey rows
    assert source.tasks["train"][1].filler is source.text["train"]
    # with a corpus, a real-text task reads it (its split), and the language-modelling rows too:
    # one filler per split, shared by every task that reads real text
    fixtures = Path(__file__).parent / "fixtures"
    prepare_corpus([str(fixtures / "corpus")], "byte", tmp_path, val_fraction=0.3, seed=1, progress=False)
    cfg = NeedleBatchConfig.from_dict(
        {
            "corpus": str(tmp_path),
            "seq_len": 1024,
            "batch_tokens": 4096,
            "mix": {"niah_single_2": 1, "niah_single_3": 1},
        },
        "data",
    )
    source = NeedleBatches(cfg, seed=0, model={"chunk_size": 16})
    task = source.tasks["val"][0]
    assert task.haystack_text == "corpus" and len(task.filler.tokens) != len(source.tasks["train"][0].filler.tokens)
    for split in ("train", "val"):
        assert all(t.filler is source.text[split] for t in source.tasks[split])
    rows = [TOK.decode(row.tolist()) for row in source.eval_batch(0)["input_ids"]]
    assert all("The special magic " in row and "The grass is green" not in row for row in rows)
