import json

import numpy as np
import pytest
import torch

from farsight.cli import main
from farsight.data.tasks import RepeatedFiller, make_task
from farsight.data.tokenizers import load_tokenizer
from farsight.errors import InputError
from farsight.eval import needle
from farsight.eval.decoding import greedy_continuation
from farsight.eval.needle import (
    TrialResult,
    evaluate_needle_task,
    format_length,
    parse_length,
    results_table,
    score_answer,
    summarize,
    trials_per_length,
    wilson_interval,
)
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

TOK = load_tokenizer("byte")


def tiny_drt():
    torch.manual_seed(0)
    cfg = DRTConfig(
        vocab_size=260, d_model=32, n_layers=2, n_heads=2, chunk_size=16, window=24, top_k=2, encoder_layers=1
    )
    return DRTForCausalLM(cfg).eval()


def test_lengths_parse_and_format():
    assert parse_length("1k") == 1024 and parse_length("16M") == 16 * 2**20 and parse_length("1500") == 1500
    assert format_length(1 << 20) == "1M" and format_length(4096) == "4K" and format_length(1000) == "1000"
    with pytest.raises(ValueError, match="cannot read length"):
        parse_length("lots")


def test_exact_match_needs_every_token():
    assert score_answer(np.array([1, 2, 3]), np.array([1, 2, 3])) == (True, True)
    assert score_answer(np.array([1, 2, 4]), np.array([1, 2, 3])) == (False, True)
    assert score_answer(np.array([0, 2, 3]), np.array([1, 2, 3])) == (False, False)
    # with a blank lead token the first token scored is the one after it
    assert score_answer(np.array([1, 5, 3]), np.array([1, 2, 3]), lead=1) == (False, False)
    assert score_answer(np.array([9, 2, 4]), np.array([1, 2, 3]), lead=1) == (False, True)


def test_an_oracle_scores_perfectly_and_a_wrong_model_does_not(monkeypatch):
    model = tiny_drt()
    task = make_task("passkey", TOK, RepeatedFiller(TOK), 16)
    lengths, depths = [200, 300], [0.0, 1.0]
    truth = {}
    for length in lengths:
        for di, depth in enumerate(depths):
            for t in range(2):
                s = task.sample(length, depth, needle.trial_rng(0, length, di, t))
                truth[tuple(s.prompt.tolist())] = s.answer
                assert s.prompt[len(s.question) :].tolist() == list(b" is")

    def oracle(decoder, prompt, steps, on_tokens=None, block=0, lead_in=None, aligned=True):
        # the evaluation prefills the question and feeds its " is" as the lead-in
        full = torch.cat([prompt, lead_in], dim=1)
        return torch.tensor(np.stack([truth[tuple(p.tolist())] for p in full]))

    monkeypatch.setattr(needle, "greedy_continuation", oracle)
    summary = evaluate_needle_task(model, task, lengths, depths, trials=2, batch_size=2, progress=False)
    assert all(v["exact_match"] == 1.0 and v["trials"] == 4 for v in summary["by_length"].values())

    def off_by_one(decoder, prompt, steps, on_tokens=None, block=0, lead_in=None, aligned=True):
        out = oracle(decoder, prompt, steps, lead_in=lead_in)
        out[:, -1] = (out[:, -1] + 1) % 256
        return out

    monkeypatch.setattr(needle, "greedy_continuation", off_by_one)
    summary = evaluate_needle_task(model, task, lengths, depths, trials=2, progress=False)
    assert all(v["exact_match"] == 0.0 and v["first_token"] == 1.0 for v in summary["by_length"].values())
    assert "exact match %" in results_table(summary)


@pytest.mark.parametrize("kind", ["drt", "sliding"])
def test_real_decoding_runs_for_drt_and_baselines(kind):
    if kind == "drt":
        model = tiny_drt()
    else:
        model = TransformerForCausalLM(
            TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, attention="sliding", window=24)
        ).eval()
    task = make_task("passkey", TOK, RepeatedFiller(TOK), 16)
    summary = evaluate_needle_task(model, task, [200], [0.5], trials=3, batch_size=2, progress=False)
    row = summary["by_length"]["200"]
    assert row["trials"] == 3 and 0 <= row["exact_match"] <= row["first_token"] <= 1
    assert ("needle_retrieved" in row) == ("split_evidence" in row) == (kind == "drt")
    assert all((t["evidence_chunks"] is None) == (kind != "drt") for t in summary["trials"])
    assert ("split needle" in results_table(summary)) == (kind == "drt")
    predicted = [t["predicted"] for t in summary["trials"]]
    assert all(len(p) >= 1 for p in predicted)


def test_an_align_below_the_chunk_size_asks_each_question_at_its_own_offset_unpadded(monkeypatch):
    model = tiny_drt()  # chunk size 16
    calls = []

    def recording(session, prompt, steps, on_tokens=None, block=1 << 16, lead_in=None, aligned=True):
        out = greedy_continuation(session, prompt, steps, on_tokens, block, lead_in, aligned)
        calls.append((prompt.shape[1], aligned, session.prompt_offset))
        # what the prompt's tokens alone give, with no padding in front: the first answer token
        reference = model(torch.cat([prompt, lead_in], 1)).logits[:, -1].argmax(-1)
        assert aligned or torch.equal(out[:, 0], reference)
        return out

    monkeypatch.setattr(needle, "greedy_continuation", recording)
    unaligned = make_task("passkey", TOK, RepeatedFiller(TOK), align=4)
    summary = evaluate_needle_task(model, unaligned, [200], [0.0, 1.0], trials=6, progress=False)
    assert summary["question_offsets"] == "any multiple of 4 within a chunk"
    assert all(not aligned and offset == 0 for _, aligned, offset in calls)
    ends = {length % 16 for length, _, _ in calls}
    assert len(ends) > 1 and ends <= {0, 4, 8, 12}  # the question's head ends on a multiple of align
    calls.clear()
    aligned_task = make_task("passkey", TOK, RepeatedFiller(TOK), align=16)
    summary = evaluate_needle_task(model, aligned_task, [200], [0.0, 1.0], trials=6, progress=False)
    assert summary["question_offsets"] == "chunk boundary"
    assert all(aligned and (length + offset) % 16 == 0 for length, aligned, offset in calls)
    with pytest.raises(InputError, match="align 3 does not divide the model's chunk size 16"):
        evaluate_needle_task(
            model, make_task("passkey", TOK, RepeatedFiller(TOK), align=3), [200], [0.0], trials=1, progress=False
        )


def test_needle_jitter_draws_every_shift_on_the_haystack_side_of_the_depth():
    early = {needle.needle_shift(8, 0.3, np.random.default_rng(i)) for i in range(300)}
    late = {needle.needle_shift(8, 0.7, np.random.default_rng(i)) for i in range(300)}
    assert early == set(range(8)) and late == set(range(-7, 1))
    assert needle.needle_shift(0, 0.3, np.random.default_rng(0)) == needle.needle_shift(1, 0.9, None) == 0


def test_needle_jitter_moves_each_trials_needle_within_a_chunk_and_keeps_its_passkey(monkeypatch):
    model = tiny_drt()  # chunk size 16
    task = make_task("passkey", TOK, RepeatedFiller(TOK), align=16)
    placed, sample = [], task.sample

    def recording(*args, **kwargs):
        drawn = sample(*args, **kwargs)
        placed.append(drawn.needle_positions[0])
        return drawn

    monkeypatch.setattr(task, "sample", recording)
    grid = ([400], [0.25, 0.75], 8)
    fixed = evaluate_needle_task(model, task, *grid, progress=False)
    at_depth, placed[:] = placed[:], []
    moved = evaluate_needle_task(model, task, *grid, progress=False, needle_jitter=16)
    assert fixed["needle_jitter"] == 0 and moved["needle_jitter"] == 16
    assert [t["answer"] for t in moved["trials"]] == [t["answer"] for t in fixed["trials"]]
    # without jitter every trial of a cell holds its needle at one offset within a chunk
    assert len({p % 16 for p in at_depth[:8]}) == len({p % 16 for p in at_depth[8:]}) == 1
    assert len({p % 16 for p in placed[:8]}) > 1 and len({p % 16 for p in placed[8:]}) > 1
    assert all(0 <= m - f < 16 for m, f in zip(placed[:8], at_depth[:8]))
    assert all(-16 < m - f <= 0 for m, f in zip(placed[8:], at_depth[8:]))
    # the 6 evidence tokens (" " and 5 digits) span two chunks where they start past offset 10
    intro = len(TOK.encode(" The passkey is:"))
    split = [(p + intro) % 16 > 10 for p in placed]
    assert [t["evidence_chunks"] for t in moved["trials"]] == [2 if s else 1 for s in split] and 0 < sum(split) < 16
    assert moved["by_length"]["400"]["split_evidence"] == {
        "trials": sum(split),
        "exact": sum(t["exact"] for t, s in zip(moved["trials"], split) if s),
    }
    assert "split needle: exact" in results_table(moved)
    with pytest.raises(InputError, match="needle_jitter must be >= 0"):
        evaluate_needle_task(model, task, [400], [0.5], 1, progress=False, needle_jitter=-1)


@pytest.mark.parametrize("mode", ["autocast-bf16", "bf16"])
def test_an_unpadded_question_matches_the_forward_in_bf16(mode):
    model = tiny_drt()
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    prompt = torch.randint(0, 256, (2, 93))  # 93 = 5 chunks of 16 + 13: the question ends mid-chunk
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast-bf16")
    with autocast, torch.no_grad(), model.new_session(batch_size=2) as session:
        predicted = greedy_continuation(session, prompt[:, :90], 1, lead_in=prompt[:, 90:], aligned=False)
        full = model(prompt).logits[:, -1].float()
    assert session.prompt_offset == 0
    # the answer is the forward's argmax, unless the two best logits are within bf16 rounding
    best = full.gather(1, predicted)[:, 0]
    assert torch.all(best >= full.max(-1).values - 0.05 * full.abs().max())


def test_trials_per_length():
    assert trials_per_length([1024, 1 << 16, 1 << 20], 10) == {1024: 10, 1 << 16: 10, 1 << 20: 10}
    assert trials_per_length([1024, 1 << 16, 1 << 20], 10, 4) == {1024: 10, 1 << 16: 10, 1 << 20: 4}
    with pytest.raises(ValueError, match="long trials must be >= 1"):
        trials_per_length([1024], 10, 0)


@pytest.mark.parametrize(
    ("lengths", "depths", "trials", "problem"),
    [
        ([], [0.5], 2, "lengths is empty; pass at least one length"),
        ([200], [], 2, "depths is empty; pass at least one depth"),
        ([200], [0.5], 0, "trials must be a whole number >= 1, got 0 for length 200"),
        ([200, 300], [0.5], {200: 2}, "got None for length 300"),
        ([200], [1.5], 2, r"depths 1.5 is outside \[0, 1\]"),
        ([200.5], [0.5], 2, "lengths holds 200.5; a length is a whole number of tokens"),
    ],
)
def test_a_grid_without_a_trial_to_run_is_refused_before_the_model_runs(lengths, depths, trials, problem):
    task = make_task("passkey", TOK, RepeatedFiller(TOK), 16)
    with pytest.raises(InputError, match=problem):
        evaluate_needle_task(tiny_drt(), task, lengths, depths, trials, progress=False)


def test_cli_eval_writes_json_and_heatmap(tmp_path):
    model = tiny_drt()
    model.save_pretrained(tmp_path / "m", tokenizer=TOK)
    code = main(
        [
            "eval",
            "passkey",
            "--model",
            str(tmp_path / "m"),
            "--lengths",
            "160,256",
            "--depths",
            "0,1",
            "--trials",
            "1",
            "--filler",
            "repeat",
            "--seed",
            "3",
            "--task-option",
            "digits=4",
            "--needle-jitter",
            "16",
            "--out",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "h.png"),
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    assert set(summary["by_length"]) == {"160", "256"} and len(summary["by_cell"]) == 4
    # what drew the trials, so that the record names its grid
    assert summary["seed"] == 3 and summary["task_options"] == {"digits": 4} and summary["needle_jitter"] == 16
    assert all(len(trial["answer"].strip()) == 4 for trial in summary["trials"])
    assert main(["eval", "passkey", "--model", str(tmp_path / "m"), "--needle-jitter", "-1"]) == 2
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_puts_models_side_by_side(tmp_path, capsys):
    def summary(rates):
        return {
            "task": "passkey",
            "by_length": {str(n): {"trials": 4, "exact_match": r, "first_token": r} for n, r in rates.items()},
        }

    (tmp_path / "a.json").write_text(json.dumps(summary({1024: 1.0, 4096: 0.75})))
    (tmp_path / "b.json").write_text(json.dumps(summary({1024: 0.5})))
    code = main(
        [
            "eval",
            "compare",
            str(tmp_path / "a.json"),
            str(tmp_path / "b.json"),
            "--labels",
            "drt,base",
            "--plot",
            str(tmp_path / "c.png"),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["length", "drt", "base"]
    assert lines[3].split() == ["1K", "100", "50"] and lines[4].split() == ["4K", "75", "-"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "compare", str(tmp_path / "a.json"), "--labels", "x,y"]) == 2
    assert main(["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--labels", "drt, drt"]) == 2
    assert "both hold length 1K" in capsys.readouterr().err
    # one model's grid run in parts: its files share a label and their lengths are joined
    (tmp_path / "long.json").write_text(json.dumps(summary({1 << 20: 0.25})))
    assert (
        main(
            [
                "eval",
                "compare",
                str(tmp_path / "a.json"),
                str(tmp_path / "long.json"),
                str(tmp_path / "b.json"),
                "--labels",
                "drt,drt,base",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["length", "drt", "base"]
    assert lines[3].split() == ["1K", "100", "50"] and lines[5].split() == ["1M", "25", "-"]
    assert main(["eval", "compare", str(tmp_path / "missing.json")]) == 2


def test_wilson_interval_matches_known_values_and_stays_in_bounds():
    # reference values from the closed form (Wilson 1927), z = 1.96
    assert wilson_interval(20, 20) == pytest.approx([0.8389, 1.0], abs=1e-4)
    assert wilson_interval(0, 20) == pytest.approx([0.0, 0.1611], abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    low, high = wilson_interval(45, 50)
    assert low < 0.9 < high and high - low < 0.2
    with pytest.raises(InputError, match="at least one trial"):
        wilson_interval(0, 0)


def test_summary_carries_the_exact_match_interval():
    rows = [TrialResult(1024, 0.5, i, i < 3, True, None, " 1", " 1") for i in range(4)]
    summary = summarize(rows, "passkey")
    assert summary["by_length"]["1024"]["exact_match_ci95"] == pytest.approx(wilson_interval(3, 4))
    assert "95% interval" in results_table(summary) and "30-95" in results_table(summary)
