"""`farsight train` and the terminal: -q prints errors only, -v adds debug messages, and training
from Python logs through `logging` without printing."""

import logging

import pytest
import yaml

from farsight.cli import main
from farsight.progress import progress_bars_shown
from farsight.train.trainer import train
from tests.train.conftest import tiny_config


@pytest.fixture
def train_yaml(tmp_path):
    def write(token_dir, steps=2):
        config = tiny_config(token_dir, tmp_path / "run", steps=steps, progress=True, checkpoint_interval=1)
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        return path

    return write


def test_train_quiet_prints_nothing_but_errors(token_dir, train_yaml, capsys):
    assert main(["train", "-q", str(train_yaml(token_dir))]) == 0
    assert capsys.readouterr() == ("", "")
    assert not progress_bars_shown()
    assert main(["-q", "train", str(train_yaml(token_dir, steps=3))]) == 0  # before the command, too
    assert capsys.readouterr() == ("", "")
    assert main(["train", "-q", str(train_yaml(token_dir).with_name("missing.yaml"))]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_train_says_what_it_does_by_default_and_more_with_verbose(token_dir, train_yaml, capsys):
    assert main(["train", str(train_yaml(token_dir))]) == 0
    out = capsys.readouterr().out
    assert "training in fp32 on cpu" in out and "done: step 2" in out and "checkpoint saved" not in out
    assert main(["train", "-v", str(train_yaml(token_dir, steps=3))]) == 0
    out = capsys.readouterr().out
    assert "resumed from step 2" in out and "step 3: checkpoint saved to" in out


def test_training_from_python_logs_and_prints_nothing(token_dir, tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="farsight"):
        train(tiny_config(token_dir, tmp_path / "run", steps=2))
    assert capsys.readouterr().out == ""
    assert any(r.name == "farsight.train.trainer" and "training in fp32" in r.getMessage() for r in caplog.records)
