"""Needle-in-a-haystack tasks (docs/design.md §5; Hu et al., ICML 2025, Appendix D, Table 5).

Every sample is built from token pieces (numpy arrays), never from one huge string, so a 16M-token
haystack costs only its token array. Layout of a sample of exactly `length` tokens:

    [filler with the needle(s) inserted at the requested depth(s)] [question head]
    | chunk boundary | [" is"] [answer] ["."] [trailing filler]

The question head ends on a multiple of `align` (the DRT chunk size), so the model's landmark
falls right before " is" and the chunk that holds the answer retrieves with the whole question
(the paper pads the same way). With align=1 the question falls anywhere; the needle evaluation
then prefills `question` (a DRT session left-pads it to a chunk boundary) and feeds `lead_in`. `prompt` is everything before the answer; exact match compares
the greedily decoded continuation with `answer`.

Tasks:
- passkey:  needle "The passkey is: {P}." ; question "What is the passkey? The passkey" | " is {P}."
- multikey: n needles "The pass key of {key_i} is: {P_i}." ; asks one key
- niah2hop: lines "DEF {a}->{b}", "DEF {b}->{c}" plus distractor chains, shuffled into the filler;
            question "The path from {a}" | " is: {b}, {c}"
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farsight.data.tasks.filler import Filler
from farsight.errors import InputError


@dataclass
class NeedleSample:
    """input_ids [length] (prompt + answer + tail); answer_start: index of the first answer token;
    needle_positions / needle_lengths: where each needle sits, the asked one first; answer_lead:
    how many answer tokens come before the first one with a letter or digit (the byte tokenizer's
    " " before the digits, the 2-hop answer's ": "), which first-token accuracy skips;
    question_start / question_end: the question's first token and the end of its head;
    quizzes: questions inside the haystack about other needles, answered there (training data
    for recall among look-alike needles), as (question start, end of the question's first
    mention of the key, answer start, answer length, start of the quizzed needle's value: the
    quiz's evidence, as long as its answer)."""

    input_ids: np.ndarray
    answer_start: int
    answer_length: int
    needle_positions: list[int]
    needle_lengths: list[int]
    depth: float
    evidence: list[tuple[int, int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    answer_lead: int = 0
    question_end: int | None = None
    question_start: int | None = None
    quizzes: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    @property
    def prompt(self) -> np.ndarray:
        return self.input_ids[: self.answer_start]

    @property
    def question(self) -> np.ndarray:
        """The prompt up to the end of the question head: what a DRT session aligns to a chunk
        boundary, so the landmark falls before " is" as in the paper (Appendix D)."""
        return self.input_ids[: self.answer_start if self.question_end is None else self.question_end]

    @property
    def lead_in(self) -> np.ndarray:
        """The prompt's tokens after the question head (" is"), fed before decoding the answer."""
        return self.input_ids[len(self.question) : self.answer_start]

    @property
    def answer(self) -> np.ndarray:
        return self.input_ids[self.answer_start : self.answer_start + self.answer_length]

    def retrieval_targets(self, chunk_size: int = 1) -> np.ndarray:
        """int16 [length]: 1 for the evidence's tokens, 2 for the answer tokens whose retrieval
        should find it, 0 elsewhere: a causal-retrieval model's `retrieval_targets`. A token of
        chunk c reads the retrieval made at the end of chunk c - 1 (`chunk_size` tokens a chunk),
        so only the answer tokens of chunks that start after the question's head are marked: an
        earlier retrieval has not read which key is asked, and no target could teach it that.
        Quiz q is the row's needle q + 1: 2q + 3 for its needle's value, 2q + 4 for its answer
        tokens from the chunk after the one where it names its key."""
        targets = np.zeros(len(self.input_ids), dtype=np.int16)
        for start, n in self.evidence:
            targets[start : start + n] = 1
        asked_from = self.answer_start if self.question_end is None else self.question_end
        targets[self._asked_tokens(asked_from, self.answer_start, self.answer_length, chunk_size)] = 2
        for q, (_, key_end, answer_start, n, evidence) in enumerate(self.quizzes):
            targets[evidence : evidence + n] = 2 * q + 3
            targets[self._asked_tokens(key_end, answer_start, n, chunk_size)] = 2 * q + 4
        return targets

    def evidence_chunks(self, chunk_size: int, offset: int = 0) -> set[int]:
        """Chunks (of `chunk_size` tokens) holding part of the evidence: what a retriever must
        fetch; `offset` tokens precede the prompt in the stream (a session's alignment padding)."""
        spans = [(offset + start, n) for start, n in self.evidence]
        return {c for start, n in spans for c in range(start // chunk_size, (start + n - 1) // chunk_size + 1)}

    def loss_weights(self, answer_weight: float, needle_weight: float = 1.0, chunk_size: int = 1) -> np.ndarray:
        """Per-token loss weights (float32 [length]): `answer_weight` for the answer tokens,
        `needle_weight` for the needles' tokens and the question's up to the answer (0 keeps a
        model from learning to write needle sentences into its text), 1 for the haystack.

        A quiz weighs as the question does, and its answer tokens `answer_weight` only from the
        first chunk (of `chunk_size` tokens) after the one where the quiz first names its key: a
        token of chunk c reads the retrieval made at the end of chunk c - 1, and a retrieval made
        before the key was read cannot know which needle to fetch, so those answer tokens (and
        every one, for a model without chunks, chunk_size 1, only after the key) would be noise."""
        weights = np.ones(len(self.input_ids), dtype=np.float32)
        for position, length in zip(self.needle_positions, self.needle_lengths):
            weights[position : position + length] = needle_weight
        if self.question_start is not None:
            weights[self.question_start : self.answer_start] = needle_weight
        weights[self.answer_start : self.answer_start + self.answer_length] = answer_weight
        for start, key_end, answer, n, _ in self.quizzes:
            weights[start : answer + n] = needle_weight
            weights[self._asked_tokens(key_end, answer, n, chunk_size)] = answer_weight
        return weights

    @staticmethod
    def _asked_tokens(asked_from: int, answer: int, n: int, chunk_size: int) -> np.ndarray:
        """The answer tokens answer .. answer + n - 1 of the chunks that start at or after
        `asked_from` (where the question, or a quiz's key, has been read): those whose retrieval,
        made at the end of the chunk before, knows which needle is asked."""
        tokens = np.arange(answer, answer + n)
        return tokens[tokens // chunk_size * chunk_size >= asked_from]


@dataclass
class Draw:
    """One random instance: needles (the asked one first), question head, answer, and the
    evidence as (needle index, offset in that needle, length)."""

    needles: list[np.ndarray]
    head: np.ndarray
    answer: np.ndarray
    evidence: list[tuple[int, int, int]]
    info: dict[str, Any]


class NeedleTask:
    """Base: subclasses give the needles, the question head and the answer for one random draw."""

    name = "needle"

    def __init__(self, tokenizer: Any, filler: Filler, align: int = 1) -> None:
        if align < 1:
            raise InputError(f"align must be >= 1 (the model's chunk size), got {align}")
        self.tokenizer = tokenizer
        self.filler = filler
        self.align = align
        self._cache: dict[str, np.ndarray] = {}

    def encode(self, text: str) -> np.ndarray:
        if text not in self._cache:
            self._cache[text] = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
        return self._cache[text]

    def draw(self, rng: np.random.Generator) -> Draw:
        raise NotImplementedError

    def sample(
        self, length: int, depth: float, rng: np.random.Generator, shift: int = 0, needle_shift: int = 0
    ) -> NeedleSample:
        """A sample of exactly `length` tokens with the (first) needle at `depth` in [0, 1] of the
        haystack. `shift` moves that many filler tokens from before the question to after the
        answer, so the question ends at another offset within a chunk: without it, every sample of
        one length puts the question at the same offset (training draws it at random).
        `needle_shift` moves the asked needle that many tokens later (earlier where negative) than
        its depth, kept inside the haystack: without it, every sample of one length and depth puts
        the needle at the same offset within a chunk. Neither changes what `rng` draws."""
        if not 0.0 <= depth <= 1.0:
            raise InputError(f"depth must be in [0, 1], got {depth}")
        if shift < 0:
            raise InputError(f"shift must be >= 0, got {shift}")
        draw = self.draw(rng)
        needles, head, answer = draw.needles, draw.head, draw.answer
        is_ = self.encode(" is")
        end = self.encode(".")
        tail_len = len(is_) + len(answer) + len(end)
        prefix = length - tail_len - shift
        prefix -= prefix % self.align  # the question head ends on a multiple of `align`
        haystack = prefix - len(head)
        needed = sum(len(n) for n in needles)
        if haystack < needed:
            # the question head must end on a multiple of `align` at or after needles + head
            raise too_short(self.name, length, round_up(needed + len(head), self.align) + tail_len + shift, shift)
        filler = self.filler.take(haystack - needed, rng)
        # the first needle (the one asked about) sits at `depth`; any others at random places
        positions = [min(max(int(round(depth * len(filler))) + needle_shift, 0), len(filler))]
        positions += [int(x) for x in rng.integers(0, len(filler) + 1, size=len(needles) - 1)]
        order = sorted(range(len(needles)), key=lambda i: (positions[i], i))
        pieces, placed, cursor = [], [0] * len(needles), 0
        for i in order:
            pos, needle = positions[i], needles[i]
            pieces.append(filler[cursor:pos])
            placed[i] = sum(len(p) for p in pieces)
            pieces.append(needle)
            cursor = pos
        pieces.append(filler[cursor:])
        pieces += [head, is_, answer, end]
        trailing = length - prefix - tail_len
        if trailing:
            pieces.append(self.filler.take(trailing, rng))
        ids = np.concatenate(pieces).astype(np.int64)
        assert len(ids) == length
        evidence = [(placed[i] + offset, n) for i, offset, n in draw.evidence]
        # first-token accuracy starts at the first token with a letter or digit: 2-hop answers open
        # with ": ", which any model gets right and would make the metric say nothing
        lead = next(
            (i for i, t in enumerate(answer.tolist()) if any(ch.isalnum() for ch in self.tokenizer.decode([t]))), 0
        )
        return NeedleSample(
            ids,
            prefix + len(is_),
            len(answer),
            placed,
            [len(n) for n in needles],
            depth,
            evidence,
            draw.info,
            lead,
            prefix,
            haystack,
        )


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def too_short(task: str, length: int, shortest: int, shift: int, fix: str = "raise --lengths") -> InputError:
    """The error for a sample length below `shortest`, the exact minimum for this draw and shift."""
    moved = f" with the question {shift} tokens earlier" if shift else ""
    return InputError(
        f"length {length} is too short for the {task} task: it needs at least {shortest} tokens{moved}; {fix}"
    )


def whole_option(task: str, option: str, value: Any, minimum: int) -> int:
    """A task option that must be a whole number of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"the {task} task's option {option} must be a whole number >= {minimum}, got {value!r}")
    return value


def _digits(rng: np.random.Generator, n: int) -> str:
    return "".join(str(int(d)) for d in rng.integers(0, 10, size=n))


def _word(rng: np.random.Generator, n: int) -> str:
    letters = string.ascii_lowercase
    return "".join(letters[int(i)] for i in rng.integers(0, len(letters), size=n))


class PasskeyTask(NeedleTask):
    name = "passkey"

    def __init__(self, tokenizer: Any, filler: Filler, align: int = 1, digits: int = 5) -> None:
        super().__init__(tokenizer, filler, align)
        self.digits = whole_option(self.name, "digits", digits, 1)

    def draw(self, rng: np.random.Generator):
        key = _digits(rng, self.digits)
        answer = self.encode(" " + key)
        intro = self.encode(" The passkey is:")
        needle = np.concatenate([intro, answer, self.encode(". ")])
        head = self.encode(" What is the passkey? The passkey")
        return Draw([needle], head, answer, [(0, len(intro), len(answer))], {"passkey": key})


class MultiKeyTask(NeedleTask):
    """Several passkeys under different keys; the question asks one of them."""

    name = "multikey"

    def __init__(self, tokenizer: Any, filler: Filler, align: int = 1, keys: int = 4, digits: int = 5) -> None:
        super().__init__(tokenizer, filler, align)
        self.keys = whole_option(self.name, "keys", keys, 1)
        self.digits = whole_option(self.name, "digits", digits, 1)
        if self.keys > 26**4:
            raise InputError(
                f"the {self.name} task's option keys={keys} exceeds the {26**4} distinct 4-letter key names"
            )

    def draw(self, rng: np.random.Generator):
        names = set()
        while len(names) < self.keys:
            names.add(_word(rng, 4))
        names = sorted(names)
        values = [_digits(rng, self.digits) for _ in names]
        order = rng.permutation(len(names))
        asked = int(rng.integers(0, len(names)))
        # the asked needle goes first so that `depth` places it
        order = [asked] + [int(i) for i in order if i != asked]
        needles = [
            np.concatenate(
                [self.encode(f" The pass key of {names[i]} is:"), self.encode(" " + values[i]), self.encode(". ")]
            )
            for i in order
        ]
        head = self.encode(f" What is the pass key of {names[asked]}? The pass key of {names[asked]}")
        answer = self.encode(" " + values[asked])
        offset = len(self.encode(f" The pass key of {names[asked]} is:"))
        return Draw(needles, head, answer, [(0, offset, len(answer))], {"key": names[asked], "passkey": values[asked]})


class TwoHopTask(NeedleTask):
    """2-hop NIAH with noise chains: a->b, b->c is the chain asked; other chains are distractors."""

    name = "niah2hop"

    def __init__(self, tokenizer: Any, filler: Filler, align: int = 1, distractors: int = 2, symbol: int = 4) -> None:
        super().__init__(tokenizer, filler, align)
        self.distractors = whole_option(self.name, "distractors", distractors, 0)
        self.symbol = whole_option(self.name, "symbol", symbol, 1)
        if 26**symbol < 3 * (distractors + 1):
            raise InputError(
                f"the {self.name} task needs {3 * (distractors + 1)} distinct symbols but symbol={symbol} letters give {26**symbol}; raise symbol"
            )

    def draw(self, rng: np.random.Generator):
        n_symbols = 3 * (self.distractors + 1)
        symbols: list[str] = []
        while len(symbols) < n_symbols:
            s = _word(rng, self.symbol)
            if s not in symbols:
                symbols.append(s)
        chains = [symbols[3 * i : 3 * i + 3] for i in range(self.distractors + 1)]
        lines = [(x, y) for chain in chains for x, y in ((chain[0], chain[1]), (chain[1], chain[2]))]
        needles = [self.encode(f" DEF {x}->{y}.") for x, y in lines]
        # a->b (placed at `depth`) and b->c come first; the distractor links in random order
        needles = needles[:2] + [needles[2 + i] for i in rng.permutation(len(needles) - 2)]
        a, b, c = chains[0]
        head = self.encode(f" The path from {a}")
        answer = np.concatenate([self.encode(":"), self.encode(" " + b), self.encode(","), self.encode(" " + c)])
        return Draw(needles, head, answer, [(0, 0, len(needles[0])), (1, 0, len(needles[1]))], {"path": [a, b, c]})


TASKS: dict[str, Callable[..., NeedleTask]] = {
    "passkey": PasskeyTask,
    "multikey": MultiKeyTask,
    "niah2hop": TwoHopTask,
}


def make_task(name: str, tokenizer: Any, filler: Filler, align: int = 1, **options: Any) -> NeedleTask:
    """Task `name` of TASKS; `options` are its own settings (e.g. digits=7 for passkey)."""
    if name not in TASKS:
        raise InputError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    # the parameters after (tokenizer, filler, align) are the task's own options
    valid = list(inspect.signature(TASKS[name]).parameters)[3:]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise InputError(
            f"option(s) {', '.join(unknown)} not valid for the {name} task; valid options: {', '.join(valid)}"
        )
    return TASKS[name](tokenizer, filler, align, **options)
