import os
import stat

import pytest

from farsight.files import atomic_write


def test_atomic_write_gives_the_usual_permissions_and_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    old = os.umask(0o022)
    try:
        atomic_write(path, lambda tmp: open(tmp, "w").write("new"))
    finally:
        os.umask(old)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o644

    def fail(tmp):
        open(tmp, "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.txt"]
