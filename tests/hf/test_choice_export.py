"""`farsight eval passkey --export-choice`: needle prompts at any offset as lm-eval multiple-choice
tasks; lm-eval's accuracy through the "farsight" model equals the choice a session ranks first."""

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from farsight.cli import main  # noqa: E402
from farsight.data.tasks import RepeatedFiller, make_task  # noqa: E402
from farsight.data.tokenizers import load_tokenizer  # noqa: E402
from farsight.errors import InputError  # noqa: E402
from farsight.eval.choice import choice_items  # noqa: E402
from farsight.hf.harness import evaluate  # noqa: E402
from farsight.models import load_model  # noqa: E402


def test_items_hold_the_answer_among_distinct_distractors():
    tok = load_tokenizer("byte")
    task = make_task("passkey", tok, RepeatedFiller(tok), align=1)
    items = choice_items(task, 300, [0.2, 0.8], 3, choices=4, seed=1)
    assert len(items) == 6 and items == choice_items(task, 300, [0.2, 0.8], 3, choices=4, seed=1)
    for item in items:
        answer = item["choices"][item["gold"]]
        assert f"The passkey is: {answer}." in item["input"] and item["input"].endswith("The passkey is")
        assert len(set(item["choices"])) == 4 and all(len(c) == len(answer) and c.isdigit() for c in item["choices"])
    assert len({item["gold"] for item in items}) > 1
    # a jittered grid asks the same passkeys among the same choices, its needles elsewhere
    moved = choice_items(task, 300, [0.2, 0.8], 3, choices=4, seed=1, needle_jitter=16)
    assert [(m["choices"], m["gold"]) for m in moved] == [(i["choices"], i["gold"]) for i in items]
    assert any(m["input"] != i["input"] for m, i in zip(moved, items))
    with pytest.raises(InputError, match="at least 2 choices"):
        choice_items(task, 300, [0.5], 1, choices=1)


def test_lm_eval_accuracy_equals_the_sessions_ranking(drt_dir, tmp_path, capsys):
    out = tmp_path / "tasks"
    code = main(
        [
            "eval",
            "passkey",
            "--model",
            str(drt_dir),
            "--filler",
            "repeat",
            "--lengths",
            "400",
            "--depths",
            "0.3,0.7",
            "--trials",
            "2",
            "--align",
            "1",
            "--export-choice",
            str(out),
        ]
    )
    assert code == 0 and "farsight_passkey_mc_400" in capsys.readouterr().out
    items = [json.loads(line) for line in (out / "data" / "farsight_passkey_mc_400.jsonl").read_text().splitlines()]
    results = evaluate(str(drt_dir), ["farsight_passkey_mc_400"], include_path=str(out), batch_size=4)
    model, tok = load_model(drt_dir), load_tokenizer(drt_dir)
    right = 0
    for item in items:
        context = torch.tensor([tok.encode(item["input"])] * 4)
        with model.new_session(batch_size=4) as session:
            session.prefill(context)
            continuations = torch.tensor([tok.encode(" " + choice) for choice in item["choices"]])
            scores = session.score(continuations).sum(1)
        right += int(scores.argmax()) == item["gold"]
    assert results["results"]["farsight_passkey_mc_400"]["acc,none"] == pytest.approx(right / len(items))
