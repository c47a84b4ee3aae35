"""A run directory has one owner: the process training it holds its lock for the whole run, so a
second `farsight train` on the same train.out_dir is refused, and a lock left by a process that
died is taken over."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from farsight.cli import main
from farsight.errors import FolderInUseError
from farsight.files import folder_lock, lock_file
from farsight.train.trainer import train
from tests.train.conftest import tiny_config


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_run_on_a_locked_out_dir_is_refused_in_one_line_and_touches_nothing(token_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_config(token_dir, run, steps=3, checkpoint_interval=3))
    before = snapshot(run)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(token_dir, run, steps=6).to_dict()))
    with folder_lock(run, "farsight train"):  # the first run, still training
        with pytest.raises(FolderInUseError, match=rf"is being written by farsight train \(pid {os.getpid()} on "):
            train(tiny_config(token_dir, run, steps=6))
        capsys.readouterr()
        assert main(["train", str(config), "--no-progress"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and re.match(
            rf"error: {re.escape(str(run))} is being written by farsight train \(pid {os.getpid()} on .*, since .*\); "
            "wait for it to end, or set train.out_dir to another folder$",
            err[0],
        ), err
    assert snapshot(run) == before  # neither resumed from its checkpoint nor cut its metrics.jsonl


def test_the_lock_of_a_killed_run_is_taken_over_and_the_run_resumes(token_dir, tmp_path, caplog):
    run = tmp_path / "run"
    train(tiny_config(token_dir, run, steps=3, checkpoint_interval=3))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = {"pid": int(gone.stdout), "host": "here", "since": "earlier", "what": "farsight train"}
    lock_file(run).write_text(json.dumps(owner))  # what a killed `farsight train` leaves: no flock on it
    with caplog.at_level("WARNING", logger="farsight.files"):
        result = train(tiny_config(token_dir, run, steps=5, checkpoint_interval=5))
    assert result.status == "completed" and result.step == 5
    assert any(f"lock left by farsight train (pid {owner['pid']} on here" in r.getMessage() for r in caplog.records)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "loss" in record] == [1, 2, 3, 4, 5]
    assert not lock_file(run).exists()


def test_an_out_dir_holding_something_else_than_a_run_is_refused(token_dir, tmp_path):
    from farsight.errors import InputError

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "config.yaml").write_text("my own config\n")
    with pytest.raises(
        InputError, match=r"train\.out_dir=.*notes holds other files \(config\.yaml\), not a training run"
    ):
        train(tiny_config(token_dir, notes))
    assert (notes / "config.yaml").read_text() == "my own config\n" and sorted(os.listdir(notes)) == ["config.yaml"]
