"""`farsight eval compare` reads needle-task results only: another command's results (generate,
ruler, ppl) or another JSON value is refused in one line naming the file."""

import json

import pytest

from farsight.cli import main
from farsight.errors import InputError
from farsight.eval.needle import compare_summaries

NEEDLE = {"task": "passkey", "by_length": {"1024": {"trials": 2, "exact_match": 0.5, "first_token": 1.0}}}
GENERATE = {
    "model": "m",
    "overall": {"examples": 3, "exact_match": 0.0},
    "by_length": [{"bucket": "4-8", "low": 4, "high": 8, "examples": 3, "exact_match": 0.0}],
}


@pytest.mark.parametrize(
    "content, problem",
    [
        (GENERATE, "the result of `farsight eval generate`"),
        ({"tasks": {}, "average": {}}, "the result of `farsight eval ruler`"),
        ({"by_length": {"1024": {"ppl": 3.2}}}, "holds no exact_match rate"),
        ([1, 2], "a JSON list"),
    ],
)
def test_compare_refuses_other_results_in_one_line(tmp_path, capsys, content, problem):
    good, other = tmp_path / "good.json", tmp_path / "other.json"
    good.write_text(json.dumps(NEEDLE))
    other.write_text(json.dumps(content))
    assert main(["eval", "compare", str(good), str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {other} is not a needle-task result") and problem in err
    assert len(err.splitlines()) == 1


def test_compare_summaries_checks_each_summary():
    with pytest.raises(InputError, match="the result of `farsight eval generate`"):
        compare_summaries([("a", NEEDLE), ("b", GENERATE)])
    table, series = compare_summaries([("a", NEEDLE)])
    assert series == {"a": {1024: 50.0}}
