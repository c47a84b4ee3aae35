import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from farsight.cli import main
from farsight.data.tasks.ruler import make_ruler_tasks
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError
from farsight.eval import needle
from farsight.eval.ruler import average_table, evaluate_ruler, export_lm_eval, ruler_items, ruler_table, string_match
from farsight.models import DRTConfig, DRTForCausalLM

BYTE = load_tokenizer("byte")
DEMO = Path(__file__).parents[2] / "models" / "demo-drt"
UTILS = Path(__file__).parents[2] / "farsight" / "eval" / "lm_eval_tasks" / "ruler" / "utils.py"


def tiny_drt():
    torch.manual_seed(0)
    cfg = DRTConfig(
        vocab_size=260, d_model=32, n_layers=2, n_heads=2, chunk_size=16, window=24, top_k=2, encoder_layers=1
    )
    return DRTForCausalLM(cfg).eval()


def test_string_match_is_the_fraction_of_references_found_and_the_lm_eval_utils_agree():
    spec = importlib.util.spec_from_file_location("ruler_utils", UTILS)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    cases = [
        (" 1234567.", ["1234567"], 1.0),
        (" 7654321, 1234567", ["1234567", "7654321"], 1.0),  # any order
        ("only 1234567 here", ["1234567", "7654321", "1111111", "2222222"], 0.25),
        (" APPLE, Pear", ["apple", "pear", "plum"], 2 / 3),  # case ignored
        ("", ["x"], 0.0),
    ]
    for predicted, references, score in cases:
        assert string_match(predicted, references) == pytest.approx(score)
        assert utils.string_match(predicted, references) == pytest.approx(score)
    assert utils.process_results({"outputs": ["a", "b"]}, [" a, c"]) == {"string_match": 0.5}


def _oracle(tasks, lengths, depths, trials, transform):
    """A greedy_continuation stand-in answering every prompt of the grid with transform(answer ids)."""
    from farsight.eval.ruler import task_depths, task_seed

    truth = {}
    for task in tasks:
        for length in lengths:
            for di, depth in enumerate(task_depths(task, depths)):
                for t in range(trials):
                    s = task.sample(length, depth, needle.trial_rng(task_seed(0, task.name), length, di, t))
                    truth[tuple(s.prompt.tolist())] = transform(s.answer)

    def continuation(session, prompt, steps, on_tokens=None, block=0, lead_in=None, aligned=True):
        full = torch.cat([prompt, lead_in], dim=1)
        return torch.tensor(np.stack([truth[tuple(p.tolist())] for p in full]))

    return continuation


def test_multi_answer_scoring_counts_each_reference(monkeypatch):
    tasks = make_ruler_tasks(["niah_single_1", "niah_multivalue", "cwe"], BYTE, 16, haystack="noise", options={})
    lengths, depths = [1024, 1200], [0.0, 1.0]

    def reverse_answers(answer):  # the same references in another order: not exact, all found
        text = BYTE.decode(answer.tolist()).strip().split(", ")
        return np.asarray(BYTE.encode(" " + ", ".join(reversed(text))))

    monkeypatch.setattr(needle, "greedy_continuation", _oracle(tasks, lengths, depths, 2, reverse_answers))
    results = evaluate_ruler(tiny_drt(), tasks, lengths, depths, trials=2, progress=False)
    single, multi, cwe = (results["tasks"][name] for name in ("niah_single_1", "niah_multivalue", "cwe"))
    assert all(row["string_match"] == 1.0 for s in (single, multi, cwe) for row in s["by_length"].values())
    assert all(row["exact_match"] == 1.0 for row in single["by_length"].values())
    assert all(row["exact_match"] == 0.0 for row in multi["by_length"].values())
    assert {c["depth"] for c in cwe["by_cell"]} == {0.5} and cwe["by_length"]["1024"]["trials"] == 2  # no depth for cwe
    assert (
        all("retrieved_needle" not in t for t in cwe["trials"]) and "needle_retrieved" not in cwe["by_length"]["1024"]
    )
    assert results["average"] == {"1024": 1.0, "1200": 1.0}

    def half(answer):  # the first two of four values, then filler
        text = BYTE.decode(answer.tolist()).split(", ")
        out = BYTE.encode(", ".join(text[:2]))
        return np.asarray(out + BYTE.encode("x" * (len(answer) - len(out))))

    monkeypatch.setattr(needle, "greedy_continuation", _oracle(tasks[1:2], lengths, depths, 2, half))
    results = evaluate_ruler(tiny_drt(), tasks[1:2], lengths, depths, trials=2, progress=False)
    assert all(row["string_match"] == 0.5 for row in results["tasks"]["niah_multivalue"]["by_length"].values())
    assert "string match %" in ruler_table(results["tasks"]["niah_multivalue"])
    assert "average" in average_table(results)


def test_the_printed_table_counts_split_needles_where_the_records_do():
    row = {"trials": 8, "string_match": 0.75, "exact_match": 0.5, "first_token": 1.0, "seconds": 1.0}
    with_chunks = {
        "by_length": {"4096": {**row, "needle_retrieved": 0.875, "split_evidence": {"trials": 3, "exact": 1}}}
    }
    table = ruler_table(with_chunks)
    assert "split needle: exact" in table and "1 of 3" in table
    assert "split needle" not in ruler_table({"by_length": {"4096": row}})  # a baseline, or a task without needles


def test_lm_eval_runs_the_exported_items(tmp_path, monkeypatch):
    """The export runs in lm-eval itself: a model answering the references scores 1, a silent one 0."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    gpt2 = load_tokenizer("gpt2")
    tasks = make_ruler_tasks(["niah_single_1", "niah_multivalue"], gpt2, haystack="noise")
    names = export_lm_eval(tasks, [600], [0.0, 1.0], 2, tmp_path / "tasks")
    assert names == ["farsight_ruler_niah_single_1_600", "farsight_ruler_niah_multivalue_600"]
    items = [json.loads(line) for line in (tmp_path / "tasks" / "data" / f"{names[1]}.jsonl").read_text().splitlines()]
    assert len(items) == 4 and all(len(i["outputs"]) == 4 for i in items)
    # the same items as the farsight evaluation, measured exactly in the tokenizer's tokens
    assert items == ruler_items(tasks[1], 600, [0.0, 1.0], 2)
    assert all(i["input_tokens"] + i["answer_tokens"] + 1 == 600 for i in items)
    answers = {}
    for name in names:
        for line in (tmp_path / "tasks" / "data" / f"{name}.jsonl").read_text().splitlines():
            item = json.loads(line)
            answers[item["input"]] = " " + ", ".join(reversed(item["outputs"])) + "."

    class Oracle(LM):
        def __init__(self, silent=False):
            super().__init__()
            self.silent = silent

        def generate_until(self, requests, disable_tqdm=False):
            return ["" if self.silent else answers[r.args[0]] for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)  # only ours: fast
    for model, score in ((Oracle(), 1.0), (Oracle(silent=True), 0.0)):
        out = simple_evaluate(model=model, tasks=names, task_manager=manager)
        for name in names:
            assert out["results"][name]["string_match,none"] == score


@pytest.mark.parametrize(
    ("depths", "trials", "problem"),
    [
        ([], 2, "depths is empty"),
        ([1.5], 2, r"depths 1.5 is outside \[0, 1\]"),
        ([0.5], {700: 2}, "got None for length 600"),
    ],
)
def test_ruler_grids_without_a_trial_to_run_are_refused_for_depthless_tasks_too(tmp_path, depths, trials, problem):
    byte = load_tokenizer("byte")
    tasks = make_ruler_tasks(["cwe"], byte, haystack="noise")  # a task without depth
    with pytest.raises(InputError, match=problem):
        ruler_items(tasks[0], 600, depths, trials)
    with pytest.raises(InputError, match=problem):
        export_lm_eval(tasks, [600], depths, trials, tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists()  # refused before anything is written
    with pytest.raises(InputError, match=problem):
        evaluate_ruler(None, tasks, [600], depths, trials, progress=False)


def test_eval_ruler_command_on_the_demo_model(tmp_path, capsys):
    out = tmp_path / "ruler.json"
    code = main(
        ["eval", "ruler", "--model", str(DEMO), "--tasks", "niah_single_1,fwe", "--lengths", "512", "--depths", "0.5",
         "--trials", "1", "--haystack", "noise", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert (
        "niah_single_1 (noise haystack)" in printed
        and "string match % (RULER's score)" in printed
        and "average" in printed
    )
    results = json.loads(out.read_text())
    assert set(results["tasks"]) == {"niah_single_1", "fwe"} and set(results["average"]) == {"512"}
    trial = results["tasks"]["niah_single_1"]["trials"][0]
    assert 0 <= trial["string_match"] <= 1 and trial["retrieved_needle"] is not None


def test_eval_ruler_export_command(tmp_path, capsys):
    assert (
        main(
            [
                "eval",
                "ruler",
                "--export",
                str(tmp_path),
                "--tokenizer",
                "byte",
                "--tasks",
                "vt",
                "--lengths",
                "1k",
                "--trials",
                "1",
                "--haystack",
                "noise",
            ]
        )
        == 0
    )
    assert "farsight_ruler_vt_1k" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_farsight_ruler_template.yaml",
        "data",
        "farsight_data.py",
        "farsight_ruler_vt_1k.yaml",
        "utils.py",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "niah_single_1,passkey"], "unknown RULER task 'passkey'"),
        (
            ["--tasks", "niah_multiquery", "--lengths", "300", "--haystack", "noise"],
            "too short for the niah_multiquery task",
        ),
        (["--tasks", "niah_single_2"], "pass --corpus DIR"),
        (["--tasks", "vt", "--task-option", "hops"], "--task-option expects KEY=VALUE"),
    ],
)
def test_eval_ruler_bad_input_is_one_line(argv, message, capsys):
    assert main(["eval", "ruler", "--model", str(DEMO), "--lengths", "1k", "--trials", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eval_ruler_export_needs_a_tokenizer(tmp_path, capsys):
    assert main(["eval", "ruler", "--export", str(tmp_path), "--haystack", "noise"]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
