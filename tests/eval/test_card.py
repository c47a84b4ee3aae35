import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from farsight.cli import main
from farsight.data.tokenizers import ByteTokenizer
from farsight.errors import InputError, MissingFileError
from farsight.eval.card import model_card, training_chain
from farsight.files import sha256_file
from farsight.models import DRTConfig, DRTForCausalLM, export_model, load_model
from farsight.models.io import trained_weights

CONFIG = {
    "type": "drt",
    "vocab_size": 260,
    "d_model": 32,
    "n_layers": 4,
    "n_heads": 2,
    "chunk_size": 8,
    "window": 16,
    "top_k": 2,
    "groups": 1,
    "encoder_layers": 1,
}
NEEDLE = {
    "kind": "needle",
    "mix": {"passkey": 2, "multikey": 1},
    "corpus": "data/lm-byte",
    "curriculum": [[0, 128], [10, 512], [100, 1024]],
    "align": 1,
}


def make_run(root, out_dir, data, checkpoints, logged, init_from=None, device="auto", logged_device=None):
    """A training run: config.yaml (out_dir and train.device as written in it), metrics.jsonl with
    100 tokens per step at 1,000 tokens/s logged every 10 steps to `logged` (with `logged_device`
    as the device, when given), and checkpoints at the steps given."""
    model = DRTForCausalLM(DRTConfig(**{k: v for k, v in CONFIG.items() if k != "type"}))
    for step in checkpoints:
        model.save_pretrained(root / "checkpoints" / f"step_{step:08d}")
        ByteTokenizer().save(root / "checkpoints" / f"step_{step:08d}")
    config = {
        "model": CONFIG,
        "data": data,
        "optim": {"lr": 0.001},
        "train": {"steps": logged, "out_dir": out_dir, "init_from": init_from, "device": device},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    records = []
    for step in range(10, logged + 1, 10):
        records += [
            {
                "step": step,
                "loss": 2.0 - step / 1000,
                "tokens": step * 100,
                "tokens_per_s": 1000.0,
                "precision": "bf16-mixed",
            }
            | ({} if logged_device is None else {"device": logged_device}),
            {"step": step, "val_loss": 3.0 - step / 1000},
        ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture
def project(tmp_path, monkeypatch):
    """runs/lm (checkpoints 40 and 80, logged to 90: a crash after 80) and runs/ft, fine-tuned
    from runs/lm's step 40 with a relative init_from, as training writes them; the current
    directory is elsewhere, as it is when someone exports later."""
    root = tmp_path / "project"
    make_run(
        root / "runs" / "lm",
        "runs/lm",
        {"kind": "tokens", "path": "data/lm-byte", "seq_len": 4096, "batch_size": 4},
        [40, 80],
        90,
        device="cuda",
    )
    make_run(
        root / "runs" / "ft",
        "runs/ft",
        dict(NEEDLE),
        [20],
        20,
        init_from="runs/lm/checkpoints/step_00000040",
        logged_device="cpu",
    )
    monkeypatch.chdir(tmp_path)
    return root


def test_the_chain_follows_relative_init_from_to_the_step_it_took(project):
    stages, origin = training_chain(project / "runs" / "ft")
    assert [(s.run, s.until) for s in stages] == [(project / "runs" / "lm", 40), (project / "runs" / "ft", 20)]
    assert origin is None
    assert (stages[0].record["steps"], stages[0].record["tokens"], stages[0].record["val_loss"]) == (40, 4000, 2.96)
    # a run given itself: its newest checkpoint, not the records a crash left after it
    assert training_chain(project / "runs" / "lm")[0][0].record["steps"] == 80
    with pytest.raises(MissingFileError, match="not a training run"):
        training_chain(project / "nothing")


def test_a_chain_that_leaves_the_runs_says_where_it_started(project):
    config = yaml.safe_load((project / "runs" / "ft" / "config.yaml").read_text())
    config["train"]["init_from"] = "models/demo-drt"
    (project / "runs" / "ft" / "config.yaml").write_text(yaml.safe_dump(config))
    stages, origin = training_chain(project / "runs" / "ft")
    assert len(stages) == 1 and origin == "models/demo-drt"
    model = load_model(project / "runs" / "ft")
    assert "Stage 1 started from the weights of `models/demo-drt`" in model_card(project / "runs" / "ft", "ft")(model)


def write(path, payload):
    path.write_text(json.dumps(payload))
    return path


def needle_summary(model):
    cell = {
        "trials": 50,
        "exact_match": 0.98,
        "exact_match_ci95": [0.9, 1.0],
        "first_token": 1.0,
        "needle_retrieved": 1.0,
        "seconds": 1.5,
    }
    return {
        "task": "passkey",
        "model": model,
        "corpus": "data/lm-byte",
        "split": "val",
        "dtype": "bf16",
        "align": 1,
        "filler": "corpus",
        "by_length": {"1024": cell},
    }


def test_the_card_describes_each_stage_and_only_this_models_results(project, tmp_path):
    ft = project / "runs" / "ft"
    ppl = {
        "corpus": "data/lm-byte",
        "split": "val",
        "dtype": "bf16",
        "results": {
            str(project / "runs" / "lm"): {"by_length": {"4096": {"nll": 1.2, "nll_sem": 0.01, "windows": 12}}},
            "runs/other": {"by_length": {"4096": {"nll": 9.0, "nll_sem": 0.01, "windows": 12}}},
        },
    }
    files = [write(tmp_path / "n.json", needle_summary(str(ft))), write(tmp_path / "p.json", ppl)]
    card = model_card(ft, "my-drt", files, weights_dtype="bf16")(load_model(ft))
    assert "trained on 0.0M tokens in 2 stages, weights stored in bf16" in card
    assert (
        "| 1 | `lm` | language modelling on `data/lm-byte`, 4 windows of 4,096 tokens per step | 40 | 0.00M | bf16-mixed "
        "| 0 min 4 s on cuda | 2.9600 (step 40) |" in card
    )
    # 2,000 tokens at 1,000 tokens/s, on the device the metrics logged (its config says auto)
    assert "| 20 | 0.00M | bf16-mixed | 0 min 2 s on cpu | 2.9800 (step 20) |" in card
    # the curriculum's 1K stage starts at step 100, after the 20 steps trained; answer weight: the default
    assert (
        "needle tasks (passkey 2, multikey 1) in haystacks of text of `data/lm-byte`, lengths 128 → 512 tokens, answer tokens weighted 10x"
        in card
    )
    assert "| 1K | 50 | 98 | 90-100 | 100 | 100 | 1.5 |" in card
    assert (
        "haystacks of text of data/lm-byte (val split), question padded to end on a chunk boundary, run in bf16" in card
    )  # no question_offsets: an older file
    cells = [{"length": 1024, "depth": d, "trials": 25} for d in (1.0, 0.5)]
    unaligned = write(
        tmp_path / "u.json",
        {**needle_summary(str(ft)), "question_offsets": "any multiple of 1 within a chunk", "by_cell": cells},
    )
    assert (
        "haystacks of text of data/lm-byte (val split), needle at depth 0.5, 1, question at any multiple of 1 "
        "within a chunk, run in bf16" in model_card(ft, "my-drt", [unaligned])(load_model(ft))
    )
    assert (
        "perplexity of stage 1 (`lm`, before the later stages)" in card
        and "| 4K | 12 | 1.2000 | 0.0100 |" in card
        and "9.0000" not in card
    )
    other = write(tmp_path / "o.json", needle_summary("runs/unrelated"))
    with pytest.raises(InputError, match="was measured on runs/unrelated, not on this model"):
        model_card(ft, "my-drt", [other])  # read before any model is at hand


def lm_eval_results(model: str) -> dict:
    """What `farsight eval harness --out` writes for RULER at 4K (trimmed to what a card reads)."""
    return {
        "results": {
            "niah_single_1": {
                "alias": "niah_single_1",
                "sample_len": 50,
                "4096,none": 0.92,
                "4096_stderr,none": "N/A",
                "16384,none": -1,
            },
            "farsight_passkey_mc": {"acc,none": 0.5, "acc_stderr,none": 0.25},
        },
        "n-samples": {
            "niah_single_1": {"original": 500, "effective": 50},
            "farsight_passkey_mc": {"original": 3, "effective": 3},
        },
        "lm_eval_version": "0.4.13",
        "model": model,
        "dtype": "bf16",
    }


def test_the_card_tabulates_lm_eval_results_of_this_model(project, tmp_path):
    ft = project / "runs" / "ft"
    card = model_card(ft, "my-drt", [write(tmp_path / "h.json", lm_eval_results(str(ft)))])(load_model(ft))
    assert "**lm-eval 0.4.13** (`h.json`): run through `farsight eval harness` in bf16" in card
    assert "| farsight_passkey_mc | acc | 0.500 | 0.250 | 3 |" in card
    assert "| niah_single_1 | 4096 | 0.920 | - | 50 |" in card and "16384" not in card  # -1: built for another length
    assert "sample_len" not in card  # RULER's count of items, not a score
    answers = tmp_path / "h-samples.jsonl"
    items = [
        {
            "task": "niah_single_1",
            "doc_id": i,
            "length": 4096,
            "target": [f"{i}"],
            "answer": f" {i}|`" + "x" * 100,
            "scores": {"4096": 1.0, "16384": -1},
        }
        for i in range(3)
    ]
    answers.write_text("".join(json.dumps(item) + "\n" for item in items))
    card = model_card(ft, "my-drt", [answers])(load_model(ft))
    assert "**answers** (`h-samples.jsonl`): the first 2 items of each task" in card
    assert '| niah_single_1 | 4096 | ["0"] | ` 0\\|\'' + "x" * 76 + "…` | 4096 1.0 |" in card
    assert '["2"]' not in card  # two items a task
    other_answers = tmp_path / "o-samples.jsonl"  # another model's answers: refused, not shown as this one's
    other_answers.write_text("".join(json.dumps({**item, "model": "runs/unrelated"}) + "\n" for item in items))
    with pytest.raises(InputError, match="o-samples.jsonl was measured on runs/unrelated, not on this model"):
        model_card(ft, "my-drt", [other_answers])
    with pytest.raises(InputError, match="--results names .*h-samples.jsonl twice"):
        model_card(ft, "my-drt", [answers, answers])
    answers.write_text('{"task": "t"}\n')
    with pytest.raises(InputError, match=r"h-samples\.jsonl:1: not an item's record"):
        model_card(ft, "my-drt", [answers])
    other = write(tmp_path / "o.json", lm_eval_results("runs/unrelated"))
    with pytest.raises(InputError, match="was measured on runs/unrelated, not on this model"):
        model_card(ft, "my-drt", [other])


def test_results_measured_on_one_export_go_on_the_card_of_any_copy_of_its_weights(project, tmp_path):
    ft = project / "runs" / "ft"
    trained = sha256_file(ft / "checkpoints" / "step_00000020" / "model.safetensors")
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["export", str(ft), str(first), "--dtype", "bf16"]) == 0
    assert main(["export", str(first), str(second)]) == 0  # an export of an export
    assert trained_weights(first) == trained_weights(second) == trained_weights(ft) == trained
    assert sha256_file(first / "model.safetensors") != trained  # the bf16 copy is another file
    measured = tmp_path / "n.json"
    passkey = ["eval", "passkey", "--model", str(first), "--filler", "repeat", "--lengths", "96", "--depths", "0.5"]
    assert main([*passkey, "--trials", "1", "--out", str(measured)]) == 0
    assert json.loads(measured.read_text())["trained_weights"] == trained
    shutil.rmtree(first)  # the copy measured is gone: its record still says whose weights it held
    card = model_card(ft, "my-drt", [measured])(load_model(ft))
    assert "**passkey** (`n.json`)" in card
    # a file from before farsight recorded the weights: by the weights its path holds now
    older = write(tmp_path / "o.json", needle_summary(str(second)))
    assert "**passkey** (`o.json`)" in model_card(ft, "my-drt", [older])(load_model(ft))
    ppl = {
        "corpus": "data/lm-byte",
        "split": "val",
        "dtype": "bf16",
        "results": {
            str(first): {
                "by_length": {"4096": {"nll": 1.2, "nll_sem": 0.01, "windows": 12}},
                "trained_weights": trained,
            }
        },
    }
    assert "**perplexity of this model**" in model_card(ft, "my-drt", [write(tmp_path / "p.json", ppl)])(load_model(ft))
    # the run's path, but the weights of another model (measured before it trained on, say): refused
    other = hashlib.sha256(b"another model's weights").hexdigest()
    elsewhere = write(tmp_path / "e.json", {**needle_summary(str(ft)), "trained_weights": other})
    with pytest.raises(InputError, match=f"was measured on {ft}, not on this model or a copy of its weights"):
        model_card(ft, "my-drt", [elsewhere])


@pytest.mark.parametrize(
    "payload, problem",
    [
        ("[]", "holds a JSON list"),
        ('"text"', "holds a JSON str"),
        ("{", "cannot read results file"),
        ('{"results": [1]}', "neither a needle summary, an lm-eval results file nor a perplexity file"),
        (
            '{"results": {"lm-eval": {"acc": 0.5}}}',
            "neither a needle summary, an lm-eval results file nor a perplexity file",
        ),
        (
            '{"task": "passkey", "by_length": {"1024": {"trials": 5}}}',
            "neither a needle summary, an lm-eval results file nor a perplexity file",
        ),
    ],
)
def test_results_of_another_shape_are_named(project, tmp_path, payload, problem):
    ft = project / "runs" / "ft"
    (tmp_path / "r.json").write_text(payload)
    with pytest.raises(InputError, match=problem):
        model_card(ft, "my-drt", [tmp_path / "r.json"])


def test_export_casts_the_weights_writes_the_card_and_replaces_only_a_model_directory(project, tmp_path):
    ft = project / "runs" / "ft"
    out = tmp_path / "exported"
    results = write(tmp_path / "n.json", needle_summary(str(out)))  # measured on the exported copy
    old = os.umask(0o022)
    try:
        assert main(["export", str(ft), str(out), "--dtype", "bf16", "--card", "--results", str(results)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755 and stat.S_IMODE((out / "README.md").stat().st_mode) == 0o644
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values() if t.is_floating_point())
    model = load_model(out)  # verified against checksums.json, loaded into the fp32 model
    source = load_file(ft / "checkpoints" / "step_00000020" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in source:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, source[name].to(torch.bfloat16).float()), name
    assert (out / "README.md").read_text().startswith("# exported\n")
    # a card committed beside the code passes the repository's formatter (ruff formats its Python blocks)
    ruff = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "--no-cache",
            "--line-length",
            "120",
            str(out / "README.md"),
        ],
        capture_output=True,
        text=True,
    )
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    # exported again without a card: the directory is replaced whole, no stale README.md
    assert main(["export", str(ft), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.json",
        "config.json",
        "farsight_hf.py",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(InputError, match="is not a model directory"):
        export_model(ft, tmp_path / "notes")
    assert main(["export", str(ft), str(tmp_path / "x"), "--results", "r.json"]) == 2


def test_card_samples_are_what_farsight_generate_prints_from_the_exported_model(project, tmp_path, capsys):
    ft = project / "runs" / "ft"
    out = tmp_path / "exported"
    prompts = ['def read(path):\n    """It\'s the text."""\n', ""]
    args = ["export", str(ft), str(out), "--dtype", "bf16", "--card"]
    assert main(args + [arg for prompt in prompts for arg in ("--sample", prompt)]) == 0
    card = (out / "README.md").read_text()
    assert card.index("## Samples") < card.index("## Use")
    for prompt in prompts:
        capsys.readouterr()
        assert main(["generate", "--model", str(out), "--prompt", prompt]) == 0
        printed = capsys.readouterr().out[:-1]  # less print's newline
        assert len(printed) > len(prompt) and f"\n{printed}\n```" in card
    # the command is quoted for a shell, newlines and quotes included
    assert 'farsight generate --model exported --prompt \'def read(path):\n    """It\'"\'"\'s the text."""\n\'' in card
    assert main(["export", str(ft), str(tmp_path / "y"), "--sample", "def"]) == 2
    assert "--sample goes into the model card; add --card" in capsys.readouterr().err


def test_a_bad_results_file_stops_the_export_before_it_starts(project, tmp_path, monkeypatch, capsys):
    import farsight.models

    def no_export(*args, **kwargs):
        raise AssertionError("the export started before the card's input was read")

    monkeypatch.setattr(farsight.models, "export_model", no_export)
    (tmp_path / "r.json").write_text("[]")
    args = [
        "export",
        str(project / "runs" / "ft"),
        str(tmp_path / "out"),
        "--card",
        "--results",
        str(tmp_path / "r.json"),
    ]
    assert main(args) == 2
    assert "holds a JSON list" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_an_fp16_export_refuses_weights_beyond_fp16_and_leaves_no_directory(project, tmp_path):
    ft = project / "runs" / "ft"
    model = load_model(ft)
    with torch.no_grad():
        next(model.parameters())[0] = 1e5
    model.save_pretrained(tmp_path / "big")
    with pytest.raises(InputError, match="beyond torch.float16's largest 6.55e\\+04; export in bf16 or fp32"):
        export_model(tmp_path / "big", tmp_path / "out", dtype="fp16")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
