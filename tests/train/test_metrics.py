import pytest

from farsight.errors import InputError
from farsight.train.metrics import read_metrics


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "val_loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "val_loss": 1.5}]
    path.write_text("")
    assert read_metrics(path) == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"step": 1}\nnot json\n{"step": 2}\n', ":2: invalid JSON"),
        ('[1, 2]\n{"step": 2}\n', ":1: a JSON array where a JSON object belongs"),
    ],
)
def test_a_bad_line_before_the_end_is_named(tmp_path, text, problem):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(InputError, match=problem):
        read_metrics(path)


def test_a_binary_file_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe')
    with pytest.raises(InputError, match="is not UTF-8 text"):
        read_metrics(path)
