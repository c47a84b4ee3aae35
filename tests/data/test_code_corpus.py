"""experiments/code-corpus.py, the BPE corpus held out by source, on small folders: whole packages,
pages and books held out, vendored copies, tests and duplicates left out, the same bytes on every
run, and files that `farsight data train-tokenizer` and `data prepare --val` read."""

import json
import subprocess
import sys
from pathlib import Path

from farsight.cli import main
from farsight.data.token_files import load_token_dataset

SCRIPT = Path(__file__).parents[2] / "experiments" / "code-corpus.py"


def make_sources(root: Path) -> None:
    for p in range(20):
        package = root / "src" / f"pkg{p}"
        (package / "sub").mkdir(parents=True)
        (package / "__init__.py").write_text(f'"""Package {p}."""\n')
        (package / "sub" / "core.py").write_text(f"def f{p}(x):\n    return x * {p}\n" * 20)
        (package / "tests").mkdir()
        (package / "tests" / "test_core.py").write_text(f"def test_{p}():\n    assert True\n")
        (package / "_vendor").mkdir()
        (package / "_vendor" / "copy.py").write_text(f"VENDORED = {p}\n")
    (root / "src" / "pkg0" / "dup.py").write_text((root / "src" / "pkg1" / "sub" / "core.py").read_text())
    (root / "src" / "single.py").write_text("TOP_LEVEL_MODULE = True\n")
    (root / "docs" / "library").mkdir(parents=True)
    for page in range(6):
        (root / "docs" / "library" / f"page{page}.rst.txt").write_text(f"Page {page}\n======\n\nText {page}.\n")


def run(root: Path, out: Path) -> str:
    argv = [sys.executable, str(SCRIPT), "--source", str(root / "src"), "--docs", str(root / "docs")]
    done = subprocess.run(
        [*argv, "--out", str(out), "--val-fraction", "0.3"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_code_corpus_holds_out_whole_units(tmp_path):
    make_sources(tmp_path)
    printed = run(tmp_path, tmp_path / "a")
    assert "units:" in printed and "left out: 1 a copy of a file already taken" in printed
    records = {s: [json.loads(line) for line in (tmp_path / "a" / f"{s}.jsonl").open()] for s in ("train", "val")}
    units = {s: {r["unit"] for r in rs} for s, rs in records.items()}
    assert units["train"] and units["val"] and not units["train"] & units["val"]
    every = [r for rs in records.values() for r in rs]
    ids = {r["id"] for r in every}
    assert "src/pkg3/sub/core.py" in ids and "src/single.py" in ids and "docs/library/page2.rst.txt" in ids
    assert not any("/tests/" in i or "/_vendor/" in i for i in ids)  # tests and vendored copies left out
    assert "src/pkg0/dup.py" in ids and "src/pkg1/sub/core.py" not in ids  # a copy: the first in order is kept
    by_unit = {r["id"]: r["unit"] for r in every}
    assert by_unit["src/pkg3/sub/core.py"] == by_unit["src/pkg3/__init__.py"] == "src/pkg3"
    assert by_unit["src/single.py"] == "src/single"
    assert by_unit["docs/library/page2.rst.txt"] == "docs/library/page2.rst.txt"
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["val_units"] == sorted(units["val"])
    assert sum(c["documents"] for c in manifest["counts"].values()) == len(every)
    run(tmp_path, tmp_path / "b")
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                "--source",
                str(tmp_path / "a" / "train.jsonl"),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "bpe"),
            ]
        )
        == 0
    )
    argv = [
        "data",
        "prepare",
        "--source",
        str(tmp_path / "a" / "train.jsonl"),
        "--val",
        str(tmp_path / "a" / "val.jsonl"),
    ]
    assert main([*argv, "--tokenizer", str(tmp_path / "bpe"), "--out", str(tmp_path / "tokens")]) == 0
    val = load_token_dataset(tmp_path / "tokens", "val")
    assert val.num_documents == len(records["val"]) and val.tokenizer.kind == "bpe"
