"""A run directory read back (to resume, to summarise, to load its model) is checked before it is
trusted: a file that is missing, empty or damaged is named in one line with the fix, never a
traceback of json, nor a step taken on trust."""

import json
import shutil

import pytest

from farsight.cli import main
from farsight.errors import FarsightError
from farsight.train.checkpoint import CheckpointError, load_trainer_state, verify_checkpoint
from farsight.train.trainer import train
from tests.train.conftest import tiny_config

STEP = "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def run(token_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    train(tiny_config(token_dir, out, steps=2))
    return out


def damaged_run(run, tmp_path, name, damage):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    damage(copy / name)
    return copy


def garble(path):
    path.write_bytes(b"\xff\xfe not what was written \x00")


def make_folder(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    "name, damage, problem",
    [
        (f"{STEP}/config.json", garble, "is not UTF-8 text"),
        (
            f"{STEP}/config.json",
            lambda p: p.write_text("[]"),
            "is corrupted \\(a JSON array where a JSON object belongs",
        ),
        (f"{STEP}/checksums.json", garble, "is not UTF-8 text"),
        (f"{STEP}/checksums.json", make_folder, "is a folder, not a file"),
        ("metrics.jsonl", garble, "is not UTF-8 text"),
        ("metrics.jsonl", make_folder, "is a folder, not a file"),
    ],
)
def test_eval_runs_names_a_damaged_file_in_one_line(run, tmp_path, capsys, name, damage, problem):
    copy = damaged_run(run, tmp_path, name, damage)
    assert main(["eval", "runs", str(copy)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {copy / name} ") and problem.replace("\\", "") in err


@pytest.mark.parametrize(
    "damage, problem",
    [
        (garble, "is not UTF-8 text"),
        (lambda p: p.write_text("[]"), "a JSON array where a JSON object belongs"),
        (lambda p: p.write_text('{"files": {"config.json": {"bytes": 1}}}'), "lacks its 'sha256' field"),
        (make_folder, "is a folder, not a file"),
    ],
)
def test_a_damaged_manifest_is_a_checkpoint_error(run, tmp_path, damage, problem):
    copy = damaged_run(run, tmp_path, f"{STEP}/manifest.json", damage)
    with pytest.raises(CheckpointError, match=rf"manifest\.json .*{problem}.*; delete .* to resume from an earlier"):
        verify_checkpoint(copy / STEP)


def test_a_renamed_checkpoint_is_not_resumed_at_its_name_s_step(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / STEP).rename(copy / "checkpoints" / "step_00000009")
    with pytest.raises(CheckpointError, match=r"records step 2, not the 9 of its folder's name"):
        load_trainer_state(copy / "checkpoints" / "step_00000009")


def test_a_trainer_state_without_its_step_is_refused(run, tmp_path):
    from farsight.files import sha256_file

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    checkpoint = copy / STEP
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["step"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())  # made consistent again
    path = checkpoint / "trainer_state.json"
    manifest["files"]["trainer_state.json"] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"trainer_state\.json lacks its 'step' field"):
        load_trainer_state(checkpoint)


def test_resuming_with_a_damaged_metrics_log_is_one_line(run, tmp_path, token_dir):
    copy = damaged_run(run, tmp_path, "metrics.jsonl", make_folder)
    with pytest.raises(FarsightError, match=r"metrics\.jsonl is a folder, not a file"):
        train(tiny_config(token_dir, copy, steps=3))


@pytest.mark.parametrize(
    "damage, problem", [(lambda p: p.unlink(), "is missing"), (make_folder, "is a folder, not a file")]
)
def test_a_model_without_its_tokenizer_says_so(run, tmp_path, capsys, damage, problem):
    model = tmp_path / "model"
    shutil.copytree(run / STEP, model)
    (model / "checksums.json").unlink()  # written by an older farsight: nothing lists tokenizer.json
    damage(model / "tokenizer.json")
    assert main(["generate", "--model", str(model), "--prompt", "the", "--max-new-tokens", "1"]) == 2
    note, error = capsys.readouterr().err.splitlines()  # the note: nothing can be verified without the record
    assert note.startswith(f"note: {model} has no checksums.json")
    assert error.startswith(f"error: {model / 'tokenizer.json'} {problem}; the model directory is incomplete")
