import os
import stat

import pytest

from farsight.files import atomic_write


def write_text(text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    return write


def test_a_new_file_gets_the_umask_and_a_replaced_one_keeps_its_mode(tmp_path):
    path = tmp_path / "f.txt"
    old = os.umask(0o022)
    try:
        atomic_write(path, write_text("new"))
    finally:
        os.umask(old)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o600)
    atomic_write(path, write_text("newer"))
    assert path.read_text() == "newer" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_new_file_gets_the_umask_even_when_the_writer_recreates_it(tmp_path):
    import torch
    from safetensors.torch import save_file  # writes a new file with owner-only permissions

    path = tmp_path / "w.safetensors"
    old = os.umask(0o022)
    try:
        atomic_write(path, lambda tmp: save_file({"w": torch.zeros(2)}, tmp))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write(path, write_text("old"))

    def fail(tmp):
        write_text("half")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


# ---- what a folder holds, and claiming one to write -------------------------------------------------
def make_folder(root, name, files):
    folder = root / name
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    folder.mkdir(exist_ok=True)
    return folder


FARSIGHT_META = '{"format": "farsight-tokens"}'
KINDS = {
    "run": {"config.yaml": "", "metrics.jsonl": "", "checkpoints/step_00000001/config.json": "{}"},
    "checkpoint": {"config.json": "{}", "model.safetensors": "", "manifest.json": "{}"},
    "model": {"config.json": "{}", "model.safetensors": "", "tokenizer.json": "{}"},
    "dataset": {"meta.json": FARSIGHT_META, "train.bin": "", "tokenizer.json": "{}"},
    "tokenizer": {"tokenizer.json": "{}"},
    "tasks": {"farsight_data.py": "", "data/t.jsonl": ""},
    "results": {"passkey.json": "{}", "passkey-heatmap.png": ""},
    "other": {"todo.txt": "mine", "meta.json": '{"format": "another tool"}'},
}


def test_folder_kind_tells_every_folder_a_command_writes_by_its_files(tmp_path):
    from farsight.files import folder_kind

    for kind, files in KINDS.items():
        assert folder_kind(make_folder(tmp_path, kind, files)) == kind, kind
    assert folder_kind(tmp_path / "missing") is None
    # an empty folder, or one holding only what an interrupted write left, holds nothing
    assert folder_kind(make_folder(tmp_path, "empty", {".prepare-x1/train.bin": "", ".a.123.tmp": ""})) is None


def test_claim_output_folder_refuses_another_kind_in_one_line_unless_overwrite(tmp_path):
    from farsight.errors import InputError
    from farsight.files import claim_output_folder

    model = make_folder(tmp_path, "model", KINDS["model"])
    with pytest.raises(InputError) as refused:
        claim_output_folder(model, "dataset", name=f"--out {model}")
    message = str(refused.value)
    assert "\n" not in message
    assert f"--out {model} holds a model, not a prepared dataset" in message and "--force" in message
    assert claim_output_folder(model, "dataset", overwrite=True) == "model"
    notes = make_folder(tmp_path, "notes", KINDS["other"])
    with pytest.raises(InputError, match=r"holds other files \(meta\.json, todo\.txt\), not a tokenizer"):
        claim_output_folder(notes, "tokenizer")
    # the same kind, an empty folder or a new one are written without asking
    assert claim_output_folder(make_folder(tmp_path, "data", KINDS["dataset"]), "dataset") == "dataset"
    assert claim_output_folder(make_folder(tmp_path, "empty", {}), "run") is None
    assert claim_output_folder(tmp_path / "new" / "folder", "model") is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file, not a folder"):
        claim_output_folder(tmp_path / "file", "dataset", overwrite=True)


# ---- the lock of a folder being written ---------------------------------------------------------------
# a process that takes the lock of a folder, says so, and waits to be killed
HOLDER = """
import sys, time
from farsight.files import folder_lock
with folder_lock(sys.argv[1], "a test writer"):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_naming_the_first_and_the_lock_goes_with_it(tmp_path):
    import datetime
    import socket

    from farsight.errors import FolderInUseError
    from farsight.files import folder_lock, lock_file

    out = tmp_path / "out"
    with folder_lock(out, "farsight train"):
        assert lock_file(out) == tmp_path / ".out.lock" and lock_file(out).is_file()
        with pytest.raises(FolderInUseError) as refused, folder_lock(out, "a second writer", "set another out_dir"):
            pass
        message = str(refused.value)
        today = datetime.date.today().isoformat()
        assert message.startswith(
            f"{out} is being written by farsight train (pid {os.getpid()} on {socket.gethostname()}"
        )
        assert f"since {today} " in message and message.endswith("; wait for it to end, or set another out_dir")
        assert "\n" not in message
    assert not lock_file(out).exists()  # nothing left beside the folder
    with folder_lock(out, "the next writer"):  # free again
        pass


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    import signal
    import subprocess
    import sys

    from farsight.errors import FolderInUseError
    from farsight.files import folder_lock, lock_file

    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        with pytest.raises(FolderInUseError, match=rf"by a test writer \(pid {child.pid} on "), folder_lock(out, "me"):
            pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert lock_file(out).is_file()  # left behind by the killed process, stale now
    with caplog.at_level("WARNING", logger="farsight.files"), folder_lock(out, "me"):
        pass
    assert any(
        f"a test writer (pid {child.pid} on" in r.getMessage() and "is gone" in r.getMessage() for r in caplog.records
    )
    assert not lock_file(out).exists()


def test_save_pretrained_refuses_a_folder_another_command_wrote(tmp_path):
    from farsight.errors import InputError
    from farsight.models import TransformerConfig, TransformerForCausalLM

    model = TransformerForCausalLM(TransformerConfig(vocab_size=260, d_model=16, n_layers=1, n_heads=2))
    dataset = make_folder(tmp_path, "dataset", KINDS["dataset"])
    before = {p.name: p.read_text() for p in dataset.iterdir()}
    with pytest.raises(InputError, match=r"dataset holds a prepared dataset, whose files the model's would replace"):
        model.save_pretrained(dataset)
    assert {p.name: p.read_text() for p in dataset.iterdir()} == before
    model.save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")  # a model directory is saved over
