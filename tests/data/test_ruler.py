import dataclasses
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from farsight.data.tasks import CorpusFiller, RepeatedFiller
from farsight.data.tasks.ruler import (
    RULER_TASKS,
    CommonWordsTask,
    FrequentWordsTask,
    NIAHTask,
    make_ruler_tasks,
    ruler_task_names,
    split_answer,
)
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError

BYTE = load_tokenizer("byte")
GPT2 = load_tokenizer("gpt2")
FIXTURES = Path(__file__).parent / "fixtures" / "corpus"


def rng(seed=0):
    return np.random.default_rng(seed)


def text(tokenizer, ids):
    return tokenizer.decode(np.asarray(ids).tolist())


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
@pytest.mark.parametrize("length", [1024, 2000 + 7])
@pytest.mark.parametrize("align", [1, 32])
def test_every_task_has_the_exact_length_an_aligned_question_and_stable_text(tokenizer, length, align):
    for task in make_ruler_tasks(list(RULER_TASKS), tokenizer, align, haystack="noise"):
        s = task.sample(length, 0.5, rng())
        assert len(s.input_ids) == length, task.name
        link = len(tokenizer.encode(" is" if text(tokenizer, s.prompt).endswith(" is") else " are"))
        assert (s.answer_start - link) % align == 0, task.name  # the answer's chunk starts at the link
        # the prompt's text re-tokenizes to the same ids, so lm-eval sees the same length
        assert tokenizer.encode(text(tokenizer, s.prompt)) == s.prompt.tolist(), task.name
        assert s.info["prompt_tokens"] == len(s.prompt)
        answer = text(tokenizer, s.answer)
        assert split_answer(answer) == s.info["references"], task.name
        context = text(tokenizer, s.prompt)
        assert all(r in context for r in s.info["references"]) or task.name == "cwe" or task.name == "fwe"


def test_a_shift_moves_the_question_and_keeps_the_length():
    task = make_ruler_tasks(["niah_single_1"], BYTE, 1, haystack="noise")[0]
    plain, shifted = task.sample(1024, 0.5, rng()), task.sample(1024, 0.5, rng(), shift=5)
    assert len(shifted.input_ids) == 1024 and shifted.answer_start == plain.answer_start - 5
    assert text(BYTE, shifted.answer) == text(BYTE, plain.answer)
    with pytest.raises(InputError, match="shift must be >= 0"):
        task.sample(1024, 0.5, rng(), shift=-1)
    with pytest.raises(InputError, match="places its needles on sentence or word boundaries"):
        task.sample(1024, 0.5, rng(), needle_shift=3)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_needle_sits_at_the_requested_depth(depth):
    task = make_ruler_tasks(["niah_single_1"], BYTE, 1, haystack="noise")[0]
    s = task.sample(4096, depth, rng(1))
    intro = len(
        task.encode(
            "Special magic numbers are hidden in the text below. Memorize them: you will be asked about them.\n"
        )
    )
    question_start = text(BYTE, s.prompt).index("\nQuestion:")
    position = s.needle_positions[0]
    assert abs((position - intro) / (question_start - s.needle_lengths[0] - intro) - depth) < 0.02
    needle = text(BYTE, s.input_ids[position : position + s.needle_lengths[0]])
    value = s.info["references"][0]
    assert needle == f" The special magic number for {s.info['keys'][0]} is: {value}."
    ((start, n),) = s.evidence
    assert text(BYTE, s.input_ids[start : start + n]) == " " + value
    assert text(BYTE, s.prompt).endswith(f"Answer: The special magic number for {s.info['keys'][0]} is")


def test_samples_are_deterministic_given_the_rng():
    for task in make_ruler_tasks(list(RULER_TASKS), GPT2, 16, haystack="noise"):
        a, b, c = (task.sample(1500, 0.4, rng(seed)) for seed in (5, 5, 6))
        assert np.array_equal(a.input_ids, b.input_ids) and a.info == b.info, task.name
        assert not np.array_equal(a.input_ids, c.input_ids), task.name


def test_multi_key_value_and_query_needles():
    multikey, multivalue, multiquery, needles = make_ruler_tasks(
        ["niah_multikey_1", "niah_multivalue", "niah_multiquery", "niah_multikey_3"], BYTE, 1, haystack="noise"
    )
    s = multikey.sample(2048, 0.5, rng())
    context = text(BYTE, s.prompt)
    assert (
        len(s.needle_positions) == 4
        and len(re.findall(r"The special magic number for [a-z-]+ is: \d{7}\.", context)) == 4
    )
    assert len(s.info["references"]) == 1 and context.count(s.info["references"][0]) == 1

    s = multivalue.sample(2048, 0.5, rng())
    key = s.info["keys"][0]
    found = re.findall(rf"The special magic number for {key} is: (\d{{7}})\.", text(BYTE, s.prompt))
    assert sorted(found) == sorted(s.info["references"]) and len(found) == 4
    assert text(BYTE, s.prompt).endswith(f"The special magic numbers for {key} are")

    s = multiquery.sample(2048, 0.5, rng())
    assert len(s.info["keys"]) == 4 and len(s.info["references"]) == 4 and len(s.evidence) == 4
    for key, value in zip(s.info["keys"], s.info["references"]):
        assert f"The special magic number for {key} is: {value}." in text(BYTE, s.prompt)

    # a needle haystack: the context is distractor needles, every key and value different
    s = needles.sample(4096, 0.5, rng())
    lines = re.findall(r"The special magic uuid for ([0-9a-f-]{36}) is: ([0-9a-f-]{36})\.", text(BYTE, s.prompt))
    assert len(lines) > 20
    keys, values = zip(*lines)
    assert len(set(keys)) == len(keys) and len(set(values)) == len(values)
    assert (s.info["keys"][0], s.info["references"][0]) in lines


def test_variable_tracking_chain_resolves_to_the_answer():
    task = make_ruler_tasks(["vt"], GPT2, 1, haystack="noise", options={"chains": 3, "hops": 3})[0]
    s = task.sample(3000, 0.2, rng(2))
    assignments = re.findall(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\.", text(GPT2, s.prompt))
    assert len(assignments) == 12
    value = s.info["value"]
    holding = {value}
    for var, source in assignments:  # in text order: each chain's assignments come in order
        if source in holding:
            holding.add(var)
    assert sorted(holding - {value}) == sorted(s.info["references"]) and len(s.info["references"]) == 4


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
def test_common_words_are_the_most_common(tokenizer):
    task = make_ruler_tasks(["cwe"], tokenizer, 1, haystack="noise")[0]
    s = task.sample(8192, 0.5, rng())
    context = text(tokenizer, s.prompt).split("\n")[1]
    counts = Counter(context.split())
    common = s.info["references"]
    assert sorted(common) == common and len(common) == 10
    assert min(counts[w] for w in common) > max(c for w, c in counts.items() if w not in common)
    assert s.info["common_freq"] == min(counts[w] for w in common)


def test_frequent_words_follow_zipf_and_the_top_is_unique():
    task = make_ruler_tasks(["fwe"], GPT2, 1, haystack="noise")[0]
    s = task.sample(4096, 0.5, rng())
    counts = Counter(text(GPT2, s.prompt).split("\n")[1].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[:3] == s.info["references"]
    values = sorted(counts.values(), reverse=True)
    assert values[0] > values[1] > values[2] > values[3] and values[0] > 20


@pytest.mark.parametrize("name", list(RULER_TASKS))
def test_every_family_runs_at_tiny_lengths(name):
    options = {"common": 2, "common_freq": 6} if name == "cwe" else {}
    task = make_ruler_tasks([name], BYTE, 1, haystack="noise", options=options)[0]
    length = 768 if name == "niah_multiquery" else 512
    for depth in (0.0, 1.0):
        assert len(task.sample(length, depth, rng()).input_ids) == length


def test_corpus_haystack_puts_needles_between_words():
    corpus = "\n".join(p.read_text() for p in sorted(FIXTURES.rglob("*")) if p.is_file())
    task = NIAHTask(BYTE, CorpusFiller(np.asarray(BYTE.encode(corpus))), 1, keys=3)
    s = task.sample(3000, 0.5, rng())
    for position, n in zip(s.needle_positions, s.needle_lengths):
        assert text(BYTE, s.input_ids[position : position + n]).startswith(" The special magic number")
        assert text(BYTE, s.input_ids[position + n : position + n + 1]).startswith(" ")  # a word boundary


def test_bad_input_gets_one_line_errors_naming_the_fix():
    with pytest.raises(InputError, match="unknown RULER task 'niah'.*or all"):
        ruler_task_names("niah_single_1,niah")
    assert ruler_task_names("all") == list(RULER_TASKS)
    with pytest.raises(
        InputError, match="too short for the niah_multiquery task: it needs at least \\d+ tokens.*raise --lengths"
    ):
        make_ruler_tasks(["niah_multiquery"], BYTE, haystack="noise")[0].sample(300, 0.5, rng())
    with pytest.raises(InputError, match="too short for the cwe task"):
        make_ruler_tasks(["cwe"], BYTE, haystack="noise")[0].sample(512, 0.5, rng())
    with pytest.raises(InputError, match="real-text haystack.*--corpus DIR.*--haystack noise"):
        make_ruler_tasks(["niah_single_2"], BYTE)
    with pytest.raises(InputError, match="option\\(s\\) hops not valid for the niah_single_1 task"):
        make_ruler_tasks(["niah_single_1"], BYTE, haystack="noise", options={"hops": 2})
    with pytest.raises(InputError, match="queries=3 keys but has only keys=2"):
        make_ruler_tasks(["niah_single_1"], BYTE, haystack="noise", options={"keys": 2, "queries": 3})
    with pytest.raises(InputError, match="value_kind must be one of"):
        NIAHTask(BYTE, RepeatedFiller(BYTE), value_kind="letters")
    with pytest.raises(InputError, match="alpha must be a number >= 1"):
        FrequentWordsTask(BYTE, RepeatedFiller(BYTE), alpha=0.5)
    with pytest.raises(InputError, match="common_freq must be a whole number >= 5"):
        CommonWordsTask(BYTE, RepeatedFiller(BYTE), common_freq=4)


@pytest.mark.parametrize("align", [1, 32])
def test_too_short_states_the_exact_minimum_for_the_shift_of_the_question(align):
    niah = make_ruler_tasks(["niah_single_1"], BYTE, align=align, haystack="noise")[0]
    with pytest.raises(InputError, match="question 40 tokens earlier") as error:
        niah.sample(120, 0.5, rng(), shift=40)
    needed = int(re.search(r"at least (\d+) tokens", str(error.value)).group(1))
    niah.sample(needed, 0.5, rng(), shift=40)
    with pytest.raises(InputError, match="too short"):
        niah.sample(needed - 1, 0.5, rng(), shift=40)


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
@pytest.mark.parametrize("name", ["niah_single_1", "niah_multivalue", "niah_multiquery", "niah_multikey_3", "vt"])
def test_varied_wording_draws_every_phrasing_and_keeps_the_task_exact(tokenizer, name):
    from farsight.data.tasks.ruler import NIAH_PHRASINGS, VT_PHRASINGS

    phrasings = VT_PHRASINGS if name == "vt" else NIAH_PHRASINGS
    task = make_ruler_tasks([name], tokenizer, 16, haystack="noise", options={"wording": "varied"})[0]
    seen = set()
    for seed in range(24):
        s = task.sample(2048, 0.5, rng(seed))
        seen.add(s.info["phrasing"])
        assert len(s.input_ids) == 2048
        prompt = text(tokenizer, s.prompt)
        assert tokenizer.encode(prompt) == s.prompt.tolist(), (name, s.info["phrasing"])
        assert split_answer(text(tokenizer, s.answer)) == s.info["references"]
        # every evidence span is a needle's value (NIAH) or a whole assignment (vt), in the phrasing drawn
        spans = [text(tokenizer, s.input_ids[a : a + n]) for a, n in s.evidence]
        if name == "vt":
            opening = phrasings[s.info["phrasing"]][0].split("{")[0]
            assert all(span.startswith(opening) for span in spans)
        else:
            assert [span.strip() for span in spans] == s.info["references"]
            head = phrasings[s.info["phrasing"]][0].split("{")[0]
            needles = [text(tokenizer, s.input_ids[p : p + n]) for p, n in zip(s.needle_positions, s.needle_lengths)]
            assert all(needle.startswith(head) and needle.endswith(".") for needle in needles)
    assert seen == set(range(len(phrasings)))


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
@pytest.mark.parametrize("name", ["niah_single_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery"])
def test_composed_wording_varies_every_part_keeps_the_task_exact_and_never_says_rulers_sentences(tokenizer, name):
    from farsight.data.tasks.ruler import NIAH_NEEDLES

    task = make_ruler_tasks([name], tokenizer, 16, haystack="noise", options={"wording": "composed"})[0]
    questions, heads = set(), set()
    for seed in range(24):
        s = task.sample(1536, 0.5, rng(seed))
        assert len(s.input_ids) == 1536 and s.info["phrasing"] is None
        prompt = text(tokenizer, s.prompt)
        assert tokenizer.encode(prompt) == s.prompt.tolist()
        assert split_answer(text(tokenizer, s.answer)) == s.info["references"]
        spans = [text(tokenizer, s.input_ids[a : a + n]) for a, n in s.evidence]
        assert [span.strip() for span in spans] == s.info["references"]
        # every needle, distractors of a needle haystack included, has the drawn head
        head = s.info["needle"].split("{")[0]
        needles = [text(tokenizer, s.input_ids[p : p + n]) for p, n in zip(s.needle_positions, s.needle_lengths)]
        assert all(needle.startswith(head) and needle.endswith(".") for needle in needles)
        heads.add(next(i for i, h in enumerate(NIAH_NEEDLES) if h.split("{")[0] in s.info["needle"]))
        tail = prompt[-400:]  # the question and lead-in, after the haystack, keys written KEY
        for key in s.info["keys"]:
            tail = tail.replace(key, "KEY")
        questions.add(tail[tail.index("\n") :])
        # RULER's needle, question and lead-in (lm-eval's templates) never appear
        assert "One of the special magic" not in prompt and "mentioned in the provided text" not in prompt
        assert "Make sure to memorize it" not in prompt
    assert len(questions) >= 16 and len(heads) >= 4


def test_composed_wording_is_for_niah_tasks_only():
    with pytest.raises(InputError, match="wording must be one of \\['ruler', 'varied'\\]"):
        make_ruler_tasks(["vt"], BYTE, 1, haystack="noise", options={"wording": "composed"})


def test_ruler_wording_is_the_default_and_draws_as_before():
    plain = make_ruler_tasks(["niah_single_1", "vt"], BYTE, 1, haystack="noise")
    ruler = make_ruler_tasks(["niah_single_1", "vt"], BYTE, 1, haystack="noise", options={"wording": "ruler"})
    for a, b in zip(plain, ruler):
        x, y = a.sample(1024, 0.5, rng(3)), b.sample(1024, 0.5, rng(3))
        assert np.array_equal(x.input_ids, y.input_ids) and x.info["phrasing"] == 0
    with pytest.raises(InputError, match="wording must be one of"):
        make_ruler_tasks(["vt"], BYTE, 1, haystack="noise", options={"wording": "random"})
    with pytest.raises(InputError, match="option\\(s\\) wording not valid for the cwe task"):
        make_ruler_tasks(["cwe"], BYTE, 1, haystack="noise", options={"wording": "varied"})


# niah_multikey_2 at 2,000 tokens, its question on a multiple of 32, depth 0.4, seed 7: the digests of
# its ids before quizzes existed. A task without quizzes must draw exactly these haystacks still.
WITHOUT_QUIZZES = {
    ("byte", "ruler"): "0464a8ede0b6f48e",
    ("byte", "composed"): "a9a278168bd29f7f",
    ("gpt2", "ruler"): "d5ae23be72aee4b7",
    ("gpt2", "composed"): "b32ad3694a7af02e",
}


@pytest.mark.parametrize("tokenizer_name, wording", sorted(WITHOUT_QUIZZES))
def test_a_needle_haystack_without_quizzes_draws_as_before(tokenizer_name, wording):
    import hashlib

    tokenizer = BYTE if tokenizer_name == "byte" else GPT2
    for options in ({"wording": wording}, {"wording": wording, "quizzes": 0, "lines": 0}):
        (task,) = make_ruler_tasks(["niah_multikey_2"], tokenizer, 32, options=options)
        s = task.sample(2000, 0.4, rng(7))
        assert hashlib.sha256(s.input_ids.tobytes()).hexdigest()[:16] == WITHOUT_QUIZZES[tokenizer_name, wording]
        assert s.quizzes == []


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
@pytest.mark.parametrize("wording", ["ruler", "varied", "composed"])
@pytest.mark.parametrize("align", [1, 32])
def test_quizzes_ask_earlier_distractors_once_and_answer_them(tokenizer, wording, align):
    (task,) = make_ruler_tasks(["niah_multikey_2"], tokenizer, align, options={"wording": wording, "quizzes": 0.4})
    for seed in range(4):
        s = task.sample(3001, 0.5, rng(seed))
        assert len(s.input_ids) == 3001 and len(s.quizzes) >= 5
        prompt = text(tokenizer, s.prompt)
        assert tokenizer.encode(prompt) == s.prompt.tolist()  # the text re-tokenizes to the same ids
        asked = s.info["keys"][0]
        needle = s.info["needle"]
        quizzed = []
        for start, key_end, answer, n, evidence in s.quizzes:
            assert evidence + n < start < key_end < answer < answer + n < s.question_start
            # the quiz's evidence is its needle's value, which its answer repeats
            assert np.array_equal(s.input_ids[evidence : evidence + n], s.input_ids[answer : answer + n])
            value = text(tokenizer, s.input_ids[answer : answer + n])
            question = text(tokenizer, s.input_ids[start:key_end])
            key = re.search(r"([a-z]+-[a-z]+)$", question).group(1)
            assert key != asked
            quizzed.append(key)
            # the key's needle came earlier, holding the answer
            assert needle.format(key=key) + value + "." in text(tokenizer, s.input_ids[:start])
            # after the answer, "." and then the next needle or quiz
            assert text(tokenizer, s.input_ids[answer + n : answer + n + 1]) == "."
            # the asked needle never lands inside a quiz
            assert not start < s.needle_positions[0] <= answer + n
        assert len(set(quizzed)) == len(quizzed)
        # the sample's own question and answer are as without quizzes
        assert prompt.count(needle.format(key=asked) + " " + s.info["references"][0] + ".") == 1
        assert split_answer(text(tokenizer, s.answer)) == s.info["references"]


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
@pytest.mark.parametrize("wording", ["ruler", "composed"])
@pytest.mark.parametrize("quizzes", [0.0, 0.4])
def test_lines_put_each_needle_and_quiz_on_a_line_of_its_own(tokenizer, wording, quizzes):
    options = {"wording": wording, "quizzes": quizzes, "lines": 1}
    (task,) = make_ruler_tasks(["niah_multikey_2"], tokenizer, 32, options=options)
    for seed in range(3):
        s = task.sample(2500, seed / 2, rng(seed))
        assert s.info["lines"] and s.info["needle"].startswith("\n")
        prompt = text(tokenizer, s.prompt)
        assert tokenizer.encode(prompt) == s.prompt.tolist()  # the text re-tokenizes to the same ids
        asked, value = s.info["keys"][0], s.info["references"][0]
        head = s.info["needle"].removeprefix("\n")
        # the asked needle is a whole line, exactly once
        assert prompt.split("\n").count(head.format(key=asked) + " " + value + ".") == 1
        if wording == "ruler":
            intro = "Special magic numbers are hidden in the text below. Memorize them: you will be asked about them.\n"
            assert prompt.startswith(intro + "The special magic number for ")
            assert text(tokenizer, s.input_ids[s.question_start :]).startswith("\nQuestion: What is the special")
        # each quiz opens a line and ends where the next line opens (the last one may be followed
        # by the filler that completes the budget)
        for q, (start, _, answer, n, _) in enumerate(s.quizzes):
            assert text(tokenizer, s.input_ids[start : start + 1]).startswith("\n")
            after = text(tokenizer, s.input_ids[answer + n : answer + n + 2])
            assert after.startswith(".\n") or (q == len(s.quizzes) - 1 and after.startswith(".")), after
        assert bool(s.quizzes) == bool(quizzes)
        # without the quizzes, every line between the instruction and the question is a needle, but
        # for one needle followed by filler: the haystack's last tokens, short of a line, that fill the budget
        kept = np.ones(s.question_start, dtype=bool)
        for start, _, answer, n, _ in s.quizzes:
            kept[start : answer + n + 1] = False
        _, *body = text(tokenizer, s.input_ids[: s.question_start][kept]).split("\n")
        needle = re.compile(re.escape(head).replace(re.escape("{key}"), "[a-z]+-[a-z]+") + r" \d{7}\.")
        odd = [line for line in body if not needle.fullmatch(line)]
        assert len(body) > 20 and len(odd) <= 1 and all(needle.match(line) for line in odd), odd
        assert split_answer(text(tokenizer, s.answer)) == s.info["references"]


def test_lines_are_drawn_per_sample_and_refused_outside_a_needle_haystack():
    (task,) = make_ruler_tasks(["niah_multikey_2"], BYTE, 1, options={"lines": 0.5})
    layouts = [task.sample(1000, 0.5, rng(seed)).info["lines"] for seed in range(40)]
    assert 8 < sum(layouts) < 32
    with pytest.raises(InputError, match="lines lay out distractor needles.*set haystack: needles or leave lines at 0"):
        make_ruler_tasks(["niah_single_1"], BYTE, 1, haystack="noise", options={"lines": 0.5})
    for bad in (-0.1, 1.5, "1", True):
        with pytest.raises(InputError, match="option lines must be a number in \\[0, 1\\]"):
            make_ruler_tasks(["niah_multikey_2"], BYTE, 1, options={"lines": bad})


def test_quiz_answers_weigh_from_the_chunk_after_the_key_is_named():
    (task,) = make_ruler_tasks(["niah_multikey_2"], BYTE, 1, options={"wording": "composed", "quizzes": 0.5})
    s = task.sample(4096, 0.5, rng(2))
    assert s.quizzes
    for chunk in (1, 8, 32):
        w = s.loss_weights(10.0, 0.0, chunk)
        for start, key_end, answer, n, _ in s.quizzes:
            assert np.all(w[start:answer] == 0.0)  # the question weighs as the sample's own question
            for t in range(answer, answer + n):
                assert w[t] == (10.0 if t // chunk > (key_end - 1) // chunk else 0.0), (chunk, t)
            # the "." that ends the quiz weighs as the one after the sample's answer
            assert w[answer + n] == w[s.answer_start + s.answer_length] == 1.0
        assert np.all(w[s.answer_start : s.answer_start + s.answer_length] == 10.0)
    # chunk_size 1 (a model without chunks): every answer token of a quiz, which follows its key
    assert int(np.sum(s.loss_weights(10.0, 0.0) == 10.0)) == s.answer_length + sum(q[3] for q in s.quizzes)
    # a quiz whose answer shares the key's chunk weighs nothing there: a chunk holding the whole quiz
    wide = s.loss_weights(10.0, 0.0, 4096)
    assert int(np.sum(wide == 10.0)) == s.answer_length


def test_quizzes_are_refused_outside_a_needle_haystack_and_out_of_range():
    with pytest.raises(InputError, match="quizzes ask about distractor needles.*set haystack: needles"):
        make_ruler_tasks(["niah_single_1"], BYTE, 1, haystack="noise", options={"quizzes": 0.3})
    for bad in (-0.1, 1.5, True, "0.3"):
        with pytest.raises(InputError, match="option quizzes must be a number in \\[0, 1\\]"):
            make_ruler_tasks(["niah_multikey_2"], BYTE, 1, options={"quizzes": bad})


def test_each_quiz_is_a_needle_of_its_own_in_the_retrieval_targets():
    (task,) = make_ruler_tasks(["niah_multikey_2"], BYTE, 1, options={"wording": "composed", "quizzes": 0.5})
    s = task.sample(4096, 0.5, rng(4))
    assert len(s.quizzes) > 10
    targets = s.retrieval_targets(32)
    plain = dataclasses.replace(s, quizzes=[])
    # the sample's own needle keeps 1 and 2, as without quizzes
    assert np.array_equal(np.where(targets <= 2, targets, 0), plain.retrieval_targets(32))
    for q, (_, key_end, answer, n, evidence) in enumerate(s.quizzes):
        assert np.all(targets[evidence : evidence + n] == 2 * q + 3)
        asking = np.flatnonzero(targets == 2 * q + 4)
        assert asking.tolist() == [t for t in range(answer, answer + n) if t // 32 > (key_end - 1) // 32]
    assert targets.dtype == np.int16 and targets.max() == 2 * len(s.quizzes) + 2


@pytest.mark.parametrize("tokenizer", [BYTE, GPT2], ids=["byte", "gpt2"])
def test_coined_keys_are_new_words_distinct_and_keep_the_task_exact(tokenizer):
    from farsight.data.tasks.ruler import ADJECTIVES, NOUNS

    listed = {f"{a}-{n}" for a in ADJECTIVES for n in NOUNS}
    (task,) = make_ruler_tasks(
        ["niah_multikey_2"], tokenizer, 32, options={"key_kind": "coined", "wording": "composed", "quizzes": 0.3}
    )
    seen = []
    for seed in range(3):
        s = task.sample(3001, 0.5, rng(seed))
        prompt = text(tokenizer, s.prompt)
        assert len(s.input_ids) == 3001 and tokenizer.encode(prompt) == s.prompt.tolist()
        needle = s.info["needle"]
        keys = {k for k in re.findall(r"\b([a-z]+-[a-z]+)\b", prompt) if needle.format(key=k) in prompt}
        assert len(keys) > 15 and s.info["keys"][0] in keys
        assert all(prompt.count(needle.format(key=k)) == 1 for k in keys)  # each key has one needle
        seen += keys
        assert prompt.count(needle.format(key=s.info["keys"][0]) + " " + s.info["references"][0] + ".") == 1
    assert not set(seen) & listed
    words = [w for k in seen for w in k.split("-")]
    assert len(set(words)) > 0.9 * len(words)  # not a list the model could learn by heart
    assert 1 < np.mean([len(k) for k in seen]) / np.mean([len(k) for k in listed]) < 1.5


def test_english_keys_pair_words_of_the_long_list_and_keep_the_task_exact():
    from farsight.data.tasks.ruler import ADJECTIVES, ENGLISH_WORDS, NOUNS

    assert len(ENGLISH_WORDS) == len(set(ENGLISH_WORDS)) == 8000
    assert all(re.fullmatch(r"[a-z]{4,10}", w) for w in ENGLISH_WORDS)
    english = set(ENGLISH_WORDS)
    (task,) = make_ruler_tasks(["niah_multikey_2"], BYTE, 32, options={"key_kind": "english", "quizzes": 0.3})
    s = task.sample(3001, 0.5, rng(0))
    prompt = text(BYTE, s.prompt)
    assert BYTE.encode(prompt) == s.prompt.tolist()
    keys = set(re.findall(r"The special magic number for ([a-z]+-[a-z]+) is:", prompt))
    assert len(keys) > 15 and s.info["keys"][0] in keys
    assert all(set(k.split("-")) <= english for k in keys)
    # the words of a long list: few keys share a word, where the short lists repeat theirs
    words = [w for k in keys for w in k.split("-")]
    assert len(set(words)) > 0.9 * len(words) and len(english) > 25 * max(len(ADJECTIVES), len(NOUNS))
