"""`farsight train` on run directories that people download, share and copy, on disks that fill
up and on processes that get killed.

Each row of CASES is one case: a setup that prepares the run directory (or the failure), the
arguments of `farsight train CONFIG`, the one-line error it must print (None: it must succeed),
and a check of what must not be lost or run. Adding a case is adding a row.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from farsight.cli import main
from farsight.files import sha256_file
from farsight.models import load_model
from farsight.train.checkpoint import MANIFEST_FILE, list_checkpoints, load_trainer_state
from farsight.train.trainer import lr_at
from tests.train.conftest import tiny_config
from tests.train.test_checkpoint_kill import run_killed


@dataclass
class Env:
    run: Path  # train.out_dir
    config: Path  # the YAML file passed to `farsight train`
    marker: Path  # a planted payload creates this file if it ever runs
    monkeypatch: pytest.MonkeyPatch


class Payload:
    """A pickle that creates a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _train(*args: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        assert main(["train", str(env.config), *args]) == 0

    return setup


def _plant(name: str, *, remove: tuple[str, ...] = ()) -> Callable[[Env], None]:
    """Replace `name` in the newest checkpoint with a pickle payload and fix up the manifest, as a
    tampered download would (the checksums only catch accidents)."""

    def setup(env: Env) -> None:
        _, path = list_checkpoints(env.run / "checkpoints")[-1]
        for other in remove:
            (path / other).unlink()
        (path / name).write_bytes(pickle.dumps(Payload(env.marker)))
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in path.iterdir()
            if p.name != MANIFEST_FILE
        }
        (path / MANIFEST_FILE).write_text(json.dumps({"step": 2, "files": files}))

    return setup


def _disk_full(name_part: str) -> Callable[[Env], None]:
    """Writes to files whose name contains `name_part` fail with ENOSPC after opening (and so truncating) them."""

    def setup(env: Env) -> None:
        real_open = builtins.open

        def full_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if name_part in os.fspath(file) and any(c in mode for c in "wax+"):
                handle.close()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
            return handle

        env.monkeypatch.setattr(builtins, "open", full_open)
        env.monkeypatch.setattr(io, "open", full_open)

    return setup


def _full_disk_for_tensors(env: Env) -> None:
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    env.monkeypatch.setattr("safetensors.torch.save_file", no_space)
    env.monkeypatch.setattr("safetensors.torch.save", no_space)


def _killed_after_logging(env: Env) -> None:
    """What a SIGKILL at step 4 leaves: records past the step-2 checkpoint and a cut-off line."""
    with open(env.run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.0}\n{"step": 4, "loss": 1.0}\n{"step": 5, "lo')


def _killed_mid_checkpoint(env: Env) -> None:
    """SIGKILL while the step-4 checkpoint is being written (after step 3's)."""
    code, output = run_killed(
        env.config, "farsight.train.checkpoint", "_write_state", 2, "--set", "train.checkpoint_interval=1"
    )
    assert code == -9, output
    _newest_loads(env, 3)


def _no_cuda(env: Env) -> None:
    env.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _file_at_run(env: Env) -> None:
    env.run.write_text("not a run directory")


def _steps(env: Env) -> list[int]:
    lines = (env.run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


def _saved_config(env: Env) -> dict:
    return yaml.safe_load((env.run / "config.yaml").read_text())


def _newest_loads(env: Env, step: int) -> None:
    found = list_checkpoints(env.run / "checkpoints")
    assert found[-1][0] == step
    load_model(env.run)
    assert load_trainer_state(found[-1][1])["step"] == step


def _no_leftovers(env: Env) -> None:
    """No temporary directory of an interrupted or failed checkpoint write is left behind."""
    assert sorted(p.name for p in (env.run / "checkpoints").iterdir()) == [
        path.name for _, path in list_checkpoints(env.run / "checkpoints")
    ]


def _newest_is(step: int) -> Callable[[Env], None]:
    return lambda env: _newest_loads(env, step)


def _saved(section: str, key: str, value) -> Callable[[Env], None]:
    """The run's config.yaml holds `value` at section.key (whole, not emptied by a failed write)."""

    def check(env: Env) -> None:
        assert _saved_config(env)[section][key] == value

    return check


def _steps_are(expected: list[int]) -> Callable[[Env], None]:
    def check(env: Env) -> None:
        assert _steps(env) == expected

    return check


def _no_run_dir(env: Env) -> None:
    assert not env.run.exists()


def _file_kept(env: Env) -> None:
    assert env.run.read_text() == "not a run directory"


def _lr_applied(env: Env) -> None:
    """The resumed steps train with the new lr, and config.yaml says so."""
    assert _saved_config(env)["optim"]["lr"] == 1e-3
    records = [json.loads(line) for line in (env.run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["lr"] == pytest.approx(lr_at(3, 1e-3, 3e-4, 2, 4))


def _chain(*steps: Callable[[Env], None]) -> Callable[[Env], None]:
    def run(env: Env) -> None:
        for step in steps:
            step(env)

    return run


def _nothing(env: Env) -> None:
    """No setup: a fresh run directory."""


@dataclass(frozen=True)
class Case:
    name: str
    setup: Callable[[Env], None]
    args: tuple[str, ...]
    error: str | None  # regex for the text after "error: "; None: the command succeeds
    check: Callable[[Env], None] = _nothing


TRAINED = _train("--set", "train.steps=2")
STEPS_4 = ("--set", "train.steps=4")
LEGACY = _plant("trainer_state.pt", remove=("trainer_state.json", "trainer_state.safetensors"))
EVERY_STEP = ("--set", "train.checkpoint_interval=1")

CASES = [
    Case(
        "set-invalid-yaml",
        _nothing,
        ("--set", "train.steps=[1"),
        r"--set train\.steps=\[1 is not valid YAML .*fix the syntax",
        _no_run_dir,
    ),
    Case("set-lr-1e-3-is-a-number", _nothing, ("--set", "optim.lr=1e-3"), None, _saved("optim", "lr", 0.001)),
    Case(
        "device-cuda-without-cuda",
        _no_cuda,
        ("--set", "train.device=cuda"),
        r"train\.device=cuda but this machine has no usable CUDA device; set train\.device to auto or cpu",
        _no_run_dir,
    ),
    Case(
        "out-dir-is-a-file",
        _file_at_run,
        (),
        r"train\.out_dir=.* is a file, not a directory; set train\.out_dir",
        _file_kept,
    ),
    Case(
        "pickle-as-legacy-trainer-state",
        _chain(TRAINED, LEGACY),
        STEPS_4,
        r"holds its trainer state as a pickle \(trainer_state\.pt.*--set train\.init_from=.*--restart",
    ),
    Case(
        "pickle-as-trainer-state-tensors",
        _chain(TRAINED, _plant("trainer_state.safetensors")),
        STEPS_4,
        r"cannot read the trainer state in .*step_00000002.*delete",
    ),
    Case(
        "pickle-as-trainer-state-json",
        _chain(TRAINED, _plant("trainer_state.json")),
        STEPS_4,
        r"cannot read the trainer state in .*step_00000002.*delete",
    ),
    Case(
        "pickle-as-model-weights",
        _chain(TRAINED, _plant("model.safetensors")),
        STEPS_4,
        r"cannot read .*model\.safetensors .*delete",
    ),
    Case(
        "disk-full-writing-checkpoint",
        _chain(TRAINED, _full_disk_for_tensors),
        STEPS_4,
        r"disk full at .*step_00000004\.tmp .*free some space",
        _chain(_newest_is(2), _no_leftovers),
    ),
    Case(
        "disk-full-writing-config-yaml",
        _chain(TRAINED, _disk_full("config.yaml")),
        STEPS_4,
        r"disk full at .*config\.yaml .*free some space",
        _saved("train", "steps", 2),
    ),
    Case(
        "resume-with-changed-lr-is-refused",
        TRAINED,
        (*STEPS_4, "--set", "optim.lr=1e-3"),
        r"differs from the one .*step_00000002 was trained with: optim\.lr 0\.003 -> 0\.001; .*--allow-config-change",
        _saved("optim", "lr", 0.003),
    ),
    Case(
        "resume-with-changed-lr-allowed",
        TRAINED,
        (*STEPS_4, "--set", "optim.lr=1e-3", "--allow-config-change"),
        None,
        _lr_applied,
    ),
    Case(
        "resume-after-kill-drops-redone-steps",
        _chain(TRAINED, _killed_after_logging),
        STEPS_4,
        None,
        _steps_are([1, 2, 3, 4]),
    ),
    Case(
        "resume-after-sigkill-mid-checkpoint",
        _chain(_train(*EVERY_STEP, "--set", "train.steps=2"), _killed_mid_checkpoint),
        EVERY_STEP,
        None,
        _chain(_newest_is(6), _no_leftovers),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_train(case, token_dir, tmp_path, monkeypatch, capsys):
    env = Env(
        run=tmp_path / "run", config=tmp_path / "train.yaml", marker=tmp_path / "payload-ran", monkeypatch=monkeypatch
    )
    env.config.write_text(yaml.safe_dump(tiny_config(token_dir, env.run).to_dict()))
    case.setup(env)
    capsys.readouterr()
    code = main(["train", str(env.config), *case.args])
    err = capsys.readouterr().err
    if case.error is None:
        assert code == 0, err
    else:
        lines = err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert re.search(case.error, lines[0]), lines[0]
    assert not env.marker.exists(), "a planted pickle ran"
    case.check(env)
