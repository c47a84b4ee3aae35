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
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from farsight.cli import main
from farsight.data.token_files import prepare_corpus
from farsight.files import sha256_file
from farsight.models import load_model
from farsight.train.checkpoint import MANIFEST_FILE, STATE_JSON, list_checkpoints, load_trainer_state
from farsight.train.trainer import lr_at
from tests.train.conftest import tiny_config
from tests.train.test_checkpoint_kill import run_killed


@dataclass
class Env:
    run: Path  # train.out_dir
    config: Path  # the YAML file passed to `farsight train`
    marker: Path  # a planted payload creates this file if it ever runs
    monkeypatch: pytest.MonkeyPatch
    tokens: Path  # the shared prepared corpus (read-only: _own_corpus copies it first)
    out: str = ""  # what the command printed on stdout
    cleanups: list[Callable[[], None]] = field(default_factory=list)


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


def _set_config(env: Env, section: str, key: str, value) -> None:
    raw = yaml.safe_load(env.config.read_text())
    raw[section][key] = value
    env.config.write_text(yaml.safe_dump(raw))


def _own_corpus(env: Env) -> None:
    """data.path: a copy of the shared corpus that this case may prepare again."""
    shutil.copytree(env.tokens, env.run.parent / "corpus")
    _set_config(env, "data", "path", str(env.run.parent / "corpus"))


def _prepared_again(text: str) -> Callable[[Env], None]:
    """The corpus at data.path prepared again, from 12 documents of `text` ("same": the original
    documents, which gives the same token files)."""

    def setup(env: Env) -> None:
        docs = env.tokens.parent / "docs"
        if text != "same":
            docs = env.run.parent / "other-docs"
            docs.mkdir()
            for i in range(12):
                (docs / f"doc{i:02d}.txt").write_text(f"{i} {text} " * 60)
        prepare_corpus([str(docs)], "byte", env.run.parent / "corpus", val_fraction=0.2, seed=0, progress=False)

    return setup


def _older_checkpoint(env: Env) -> None:
    """The newest checkpoint as an older farsight wrote it: no fingerprint of its data."""
    _, path = list_checkpoints(env.run / "checkpoints")[-1]
    state = json.loads((path / STATE_JSON).read_text())
    del state["data_fingerprint"]
    (path / STATE_JSON).write_text(json.dumps(state))
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][STATE_JSON] = {
        "bytes": (path / STATE_JSON).stat().st_size,
        "sha256": sha256_file(path / STATE_JSON),
    }
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def _users_files(env: Env) -> None:
    """A user's own files in the checkpoints folder, beside what farsight wrote (a leftover of an
    interrupted checkpoint write included)."""
    root = env.run / "checkpoints"
    (root / "backup.txt").write_text("my notes")
    (root / "mine").mkdir()
    (root / "mine" / "plot.png").write_bytes(b"png")
    (root / "step_00000003.tmp").mkdir()


def _notes_as_checkpoint(env: Env) -> None:
    """A folder named like a newer checkpoint that holds only a user's notes."""
    (env.run / "checkpoints" / "step_00000003").mkdir()
    (env.run / "checkpoints" / "step_00000003" / "notes.txt").write_text("mine")


def _config_is_a_folder(env: Env) -> None:
    env.config.unlink()
    env.config.mkdir()


def _safetensors_disk_full(env: Env) -> None:
    """safetensors' own writer fails as it does on a full disk: a SafetensorError naming the OS error."""
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    env.monkeypatch.setattr("safetensors.torch.save_file", full)


def _on_small_tmpfs(env: Env) -> None:
    """The trained run moved to a tmpfs with room for its files and a third of another checkpoint
    (skipped where root cannot mount one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    used = sum(p.stat().st_size for p in env.run.rglob("*") if p.is_file())
    checkpoint = sum(p.stat().st_size for p in list_checkpoints(env.run / "checkpoints")[-1][1].iterdir())
    disk = env.run.parent / "disk"
    disk.mkdir()
    size = (used + checkpoint // 3 + 64 * 1024) // 4096 * 4096
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    env.cleanups.append(lambda: subprocess.run(["umount", str(disk)], check=True))
    shutil.copytree(env.run, disk / "run")
    env.run = disk / "run"
    _set_config(env, "train", "out_dir", str(env.run))


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


def _printed(pattern: str) -> Callable[[Env], None]:
    def check(env: Env) -> None:
        assert re.search(pattern, env.out), env.out

    return check


def _only_users_files_left(env: Env) -> None:
    """--restart removed farsight's checkpoints and leftovers, kept the user's files, said so."""
    root = env.run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["backup.txt", "mine", "step_00000002"]
    assert (root / "backup.txt").read_text() == "my notes" and (root / "mine" / "plot.png").read_bytes() == b"png"
    assert "note: kept 2 files farsight did not write in" in env.out and "backup.txt, mine" in env.out


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
        "config-is-a-folder",
        _config_is_a_folder,
        (),
        r"config file .*train\.yaml is a folder; pass the path of a YAML file",
        _no_run_dir,
    ),
    Case(
        "restart-keeps-files-farsight-did-not-write",
        _chain(_train("--set", "train.steps=4", *EVERY_STEP), _users_files),
        ("--restart", "--set", "train.steps=2"),
        None,
        _only_users_files_left,
    ),
    Case(
        "resume-on-data-prepared-again-from-other-text-is-refused",
        _chain(_own_corpus, TRAINED, _prepared_again("other words entirely")),
        STEPS_4,
        r"the data at data\.path=.*corpus is not what .*step_00000002 was trained on .*pass --allow-data-change "
        r"to continue on the new data, or --restart \(or a new train\.out_dir\)",
        _chain(_newest_is(2), _steps_are([1, 2])),
    ),
    Case(
        "resume-on-changed-data-allowed",
        _chain(_own_corpus, TRAINED, _prepared_again("other words entirely")),
        (*STEPS_4, "--allow-data-change"),
        None,
        _chain(_newest_is(4), _printed(r"data change on resume: the files at data\.path=.* \(from step 3\)")),
    ),
    Case(
        "resume-on-data-prepared-again-from-the-same-text",
        _chain(_own_corpus, TRAINED, _prepared_again("same")),
        STEPS_4,
        None,
        _chain(_newest_is(4), _steps_are([1, 2, 3, 4])),
    ),
    Case(
        "resume-of-a-checkpoint-without-data-fingerprint",
        _chain(TRAINED, _older_checkpoint),
        STEPS_4,
        None,
        _chain(_newest_is(4), _printed(r"note: .*step_00000002 records no fingerprint of its training data")),
    ),
    Case(
        "a-folder-of-notes-named-like-a-checkpoint",
        _chain(TRAINED, _notes_as_checkpoint),
        STEPS_4,
        r"step_00000003 is not a farsight checkpoint \(it holds only notes\.txt, none of config\.json.*move it out",
    ),
    Case(
        "disk-full-in-safetensors-writer",
        _chain(TRAINED, _safetensors_disk_full),
        STEPS_4,
        r"disk full at .*step_00000004\.tmp \(No space left on device\); free some space",
        _chain(_newest_is(2), _no_leftovers),
    ),
    Case(
        "disk-full-on-a-real-small-disk",
        _chain(TRAINED, _on_small_tmpfs),
        STEPS_4,
        r"disk full at .*step_00000004\.tmp \(No space left on device\)",
        _chain(_newest_is(2), _no_leftovers),
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
        run=tmp_path / "run",
        config=tmp_path / "train.yaml",
        marker=tmp_path / "payload-ran",
        monkeypatch=monkeypatch,
        tokens=token_dir,
    )
    env.config.write_text(yaml.safe_dump(tiny_config(token_dir, env.run).to_dict()))
    try:
        case.setup(env)
        capsys.readouterr()
        code = main(["train", str(env.config), *case.args])
        captured = capsys.readouterr()
        err, env.out = captured.err, captured.out
        if case.error is None:
            assert code == 0, err
        else:
            lines = err.splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
            assert re.search(case.error, lines[0]), lines[0]
        assert not env.marker.exists(), "a planted pickle ran"
        case.check(env)
    finally:
        for cleanup in env.cleanups:
            cleanup()
