"""experiments/summarize-data.py, the summarization stand-in's data, on a small folder of packages:
the answer cut out of the input, packages held out whole, lengths in range, the same files on
every run, and files that `farsight data prepare-sft` reads."""

import json
import subprocess
import sys
from pathlib import Path

from farsight.cli import main

SCRIPT = Path(__file__).parents[2] / "experiments" / "summarize-data.py"


def make_packages(root: Path) -> None:
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
    for p in range(12):
        package = root / f"pkg{p}"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        for m in range(3):
            doc = f'"""Helpers number {m} of package {p} for tests.\n\nMore words follow here.\n"""\n'
            (package / f"mod{m}.py").write_text(doc + body * (1 + m))
        (package / "short.py").write_text('"""Too short a module to keep."""\n')
        (package / "multi.py").write_text('"""A summary that\ngoes on."""\n' + body)
        (package / "leaky.py").write_text('"""Leaky summary line here."""\n# Leaky summary line here.\n' + body)
        (package / "tests").mkdir()
        (package / "tests" / "test_a.py").write_text('"""Tests of the package here."""\n' + body)
    (root / "pkg0" / "copy.py").write_text('"""Helpers number 0 of package 1 for tests."""\n' + body)


def run(source: Path, out: Path) -> str:
    argv = [sys.executable, str(SCRIPT), "--source", str(source), "--out", str(out), "--min-tokens", "300"]
    argv += ["--max-tokens", "2000", "--val-fraction", "0.25", "--test-fraction", "0.25"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_summarize_data_on_a_folder_of_packages(tmp_path, capsys):
    make_packages(tmp_path / "src")
    printed = run(tmp_path / "src", tmp_path / "a")
    assert "split" in printed and "2K-4K" in printed and "left out:" in printed
    records = {
        s: [json.loads(line) for line in (tmp_path / "a" / f"{s}.jsonl").open()] for s in ("train", "val", "test")
    }
    packages = {s: {r["package"] for r in rs} for s, rs in records.items()}
    assert all(packages.values()) and not (packages["train"] & (packages["val"] | packages["test"]))
    assert not packages["val"] & packages["test"]
    every = [r for rs in records.values() for r in rs]
    assert {r["id"].rsplit("/", 1)[1] for r in every} == {"mod0.py", "mod1.py", "mod2.py"}  # the others left out
    for r in every:
        assert r["completion"].startswith("Helpers number") and r["completion"] not in r["prompt"]
        assert r["prompt"].startswith('"""\n\nMore words follow here.')  # the summary line cut, the rest kept
        assert 300 <= len(r["prompt"].encode()) + len(r["completion"].encode()) + 1 <= 2000
    assert not any(r["id"].endswith("pkg1/mod0.py") for r in every)  # its summary is copied in pkg0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["skipped"]["summary shared with another package"] == 2
    assert sum(c["examples"] for c in manifest["counts"].values()) == len(every)
    run(tmp_path / "src", tmp_path / "b")
    for name in ("train.jsonl", "val.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    out = tmp_path / "tokens"
    argv = ["data", "prepare-sft", "--source", str(tmp_path / "a" / "train.jsonl"), "--out", str(out)]
    assert main([*argv, "--val", str(tmp_path / "a" / "val.jsonl"), "--max-len", "2000"]) == 0
    assert f"train {len(records['train'])} examples" in capsys.readouterr().out
