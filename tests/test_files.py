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
