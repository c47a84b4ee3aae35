"""`farsight eval generate` (farsight.eval.answers): greedy answers to held-out prompts through each
model's session, fed as the examples train, scored with ROUGE-1/2/L and exact match by prompt length."""

import json
import re
import sys

import pytest
import torch

from farsight.cli import main
from farsight.data.sft import encode_segments, parse_record, prompt_ids
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import MissingDependencyError
from farsight.eval import answers
from farsight.eval.answers import evaluate_answers, greedy_answer, length_buckets, rouge_scorer, spread_per_bucket
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

TOK = load_tokenizer("byte")
RECORDS = [
    {"prompt": "def add(a, b):\n    return a + b\n# Summary:", "completion": " Add two numbers."},
    {"prompt": "The capital of France is", "completion": " Paris"},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there."}]},
]


def tiny(kind):
    torch.manual_seed(0)
    small = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
    if kind == "drt":
        return DRTForCausalLM(DRTConfig(**small, chunk_size=8, window=16, top_k=2, encoder_layers=1))
    return TransformerForCausalLM(TransformerConfig(**small, attention="sliding", window=16))


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


@pytest.mark.parametrize("kind", ["sliding", "drt"])
def test_eval_generate_prints_a_table_and_writes_json(tmp_path, data, capsys, kind):
    tiny(kind).save_pretrained(tmp_path / "model", tokenizer=TOK)
    out = tmp_path / "results" / "answers.json"
    argv = ["eval", "generate", "--model", str(tmp_path / "model"), "--data", str(data), "--max-new-tokens", "6"]
    assert main([*argv, "--out", str(out), "--buckets", "16,32"]) == 0
    printed = capsys.readouterr().out
    for column in ("prompt tokens", "ROUGE-1", "ROUGE-2", "ROUGE-L", "exact match %"):
        assert column in printed
    assert "<=16" not in printed and "16-32" in printed and ">32" in printed
    assert re.search(r"^ +all +3 ", printed, re.MULTILINE)
    summary = json.loads(out.read_text())
    assert summary["overall"]["examples"] == 3
    for key in ("rouge1", "rouge2", "rougeL", "exact_match"):
        assert 0 <= summary["overall"][key] <= 1
    assert [b["bucket"] for b in summary["by_length"]] == ["16-32", ">32"]
    assert sum(b["examples"] for b in summary["by_length"]) == 3
    first = summary["answers"][0]
    assert first["reference"] == " Add two numbers." and first["new_tokens"] <= 6
    assert first["stop"] in ("eos", "newline", "length")
    assert first["prompt_tokens"] == len(TOK.encode(RECORDS[0]["prompt"]))


def test_scores_of_right_and_wrong_answers(data, monkeypatch):
    examples = [parse_record(r, f"t:{i}") for i, r in enumerate(RECORDS, 1)]
    written = iter(["Add two numbers.", "Lyon", " hi  there. "])
    monkeypatch.setattr(answers, "greedy_answer", lambda *a, **k: (next(written), 3, "eos"))
    summary = evaluate_answers(tiny("sliding"), TOK, examples, progress=False)
    exact = [a["exact"] for a in summary["answers"]]
    assert exact == [True, False, False]  # whitespace-normalised equality; case counts
    right, wrong, case = summary["answers"]
    assert right["rouge1"] == right["rouge2"] == right["rougeL"] == 1.0
    assert wrong["rouge1"] == 0.0
    assert case["rouge1"] == 1.0  # ROUGE lowercases
    assert summary["overall"]["exact_match"] == pytest.approx(1 / 3)
    assert summary["overall"]["rouge1"] == pytest.approx(2 / 3)


class FakeSession:
    """Logits that pick the given tokens in turn; records what was fed."""

    def __init__(self, tokens, reserved=None):
        self.tokens = list(tokens)
        self.fed = []
        self.model = type("M", (), {"reserved_ids": lambda self: reserved or {}})()

    def _logits(self):
        logits = torch.zeros(1, 260)
        logits[0, self.tokens.pop(0)] = 1.0
        return logits

    def prefill(self, blocks, attention_mask=None, length=None):
        assert length is None  # fed unaligned, as training examples start
        self.fed += [b for b in blocks]
        return self._logits()

    def step(self, token):
        self.fed.append(token)
        return self._logits()


def test_greedy_answer_stops_at_eos_newline_or_max_new_tokens():
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    text = [ord(c) for c in "ab\ncd"]
    assert greedy_answer(FakeSession([*text, TOK.eos_id]), prompt, 10, TOK.eos_id, TOK.decode) == ("ab\ncd", 5, "eos")
    assert greedy_answer(FakeSession(text), prompt, 10, TOK.eos_id, TOK.decode, stop_at_newline=True) == (
        "ab",
        3,
        "newline",
    )
    assert greedy_answer(FakeSession(text), prompt, 2, TOK.eos_id, TOK.decode) == ("ab", 2, "length")
    seen = []
    session = FakeSession(text)
    greedy_answer(session, prompt, 1, TOK.eos_id, TOK.decode, on_tokens=seen.append, block=2)
    assert seen == [2, 2, 1] and [b.tolist() for b in session.fed] == [[[1, 2]], [[3, 4]], [[5]]]


@pytest.mark.parametrize("kind", ["sliding", "drt"])
def test_the_prompt_is_fed_as_the_example_trains(kind):
    model = tiny(kind).eval()
    example = parse_record(RECORDS[0], "t:1")
    ids, mask = encode_segments(TOK, example.segments)
    prompt = prompt_ids(TOK, example)
    assert ids[: len(prompt)].tolist() == prompt.tolist() and mask[len(prompt)] == 1 and mask[: len(prompt)].sum() == 0
    with torch.no_grad():
        trained = model(torch.from_numpy(ids)[None]).logits[0, len(prompt) - 1]  # predicts the first answer token
    with model.new_session(batch_size=1) as session:  # unaligned, from stream position 0, in two blocks
        fed = session.prefill(iter([torch.from_numpy(prompt[None, :20]), torch.from_numpy(prompt[None, 20:])]))
    torch.testing.assert_close(fed[0], trained, rtol=1e-4, atol=1e-4)


def test_length_buckets():
    assert length_buckets([3, 5, 900]) == [(2, 4), (4, 8), (512, 1024)]
    assert length_buckets([10, 40, 5000], [16, 4096]) == [(0, 16), (16, 4096), (4096, None)]


def test_rouge_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rouge_score", None)
    with pytest.raises(MissingDependencyError, match=r"pip install farsight\[rouge\]"):
        rouge_scorer()


def test_spread_per_bucket_takes_evenly_spaced_examples_of_each_bucket():
    lengths = [10, 20, 11, 12, 13, 30, 14, 15]
    # buckets (8, 16]: indices 0, 2, 3, 4, 6, 7; (16, 32]: 1, 5
    assert spread_per_bucket(lengths, [8, 16, 32], 3) == [0, 1, 3, 5, 6]
    assert spread_per_bucket(lengths, [8, 16, 32], 10) == list(range(8))
    assert spread_per_bucket(lengths, [8, 16, 32], 1) == [0, 1]


def test_eval_generate_per_bucket(tmp_path, data, capsys):
    tiny("sliding").save_pretrained(tmp_path / "model", tokenizer=TOK)
    out = tmp_path / "answers.json"
    argv = ["eval", "generate", "--model", str(tmp_path / "model"), "--data", str(data), "--max-new-tokens", "2"]
    assert main([*argv, "--buckets", "16,32", "--per-bucket", "1", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["per_bucket"] == 1 and summary["overall"]["examples"] == 2
    assert [b["examples"] for b in summary["by_length"]] == [1, 1]
    assert main([*argv, "--per-bucket", "0"]) == 2
    assert "--per-bucket must be at least 1" in capsys.readouterr().err
