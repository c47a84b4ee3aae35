"""Every command that writes, reads a user's file or takes a number, on the mistakes people make:
exporting onto what must survive, full disks, Ctrl-C, files that do not fit together, numbers out
of range. One table: each row builds what it needs (setup: files, or a fault injected), runs one
`farsight` command, and expects its exit code, the single `error: ...` line (or success), and a
check of what must not be lost, changed or left behind. By default a refused or failed command
must leave every file as it was, temporary files and folders included. Adding a case is a row.

Disk-full rows inject ENOSPC where the bytes are written; the tmpfs rows at the end fill a real,
small file system (where the machine lets root mount one; skipped elsewhere).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from farsight.cli import main
from farsight.data.token_files import prepare_corpus
from farsight.data.tokenizers import load_tokenizer
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM, load_model
from farsight.train.checkpoint import save_checkpoint

TOK = load_tokenizer("byte")
TEXT = "alpha beta gamma delta epsilon. " * 60


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory) -> Path:
    """model/ (a saved transformer), drt/ (a DRT), run/checkpoints/step_00000040 (a checkpoint with
    its trainer state and manifest), docs/ (text files), corpus/ (prepared from docs/)."""
    root = tmp_path_factory.mktemp("fixture")
    torch.manual_seed(0)
    model = TransformerForCausalLM(TransformerConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2))
    model.save_pretrained(root / "model", tokenizer=TOK)
    DRTForCausalLM(
        DRTConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, chunk_size=8, window=16, top_k=2, encoder_layers=1)
    ).save_pretrained(root / "drt", tokenizer=TOK)
    state = {"step": 40, "optimizer": {"state": {}, "param_groups": []}, "config": {}}
    save_checkpoint(
        root / "run" / "checkpoints",
        40,
        lambda d: model.save_pretrained(d, tokenizer=TOK),
        state,
        keep_last=3,
    )
    (root / "docs").mkdir()
    for i in range(4):
        (root / "docs" / f"d{i}.txt").write_text(f"document {i}: " + TEXT)
    prepare_corpus([str(root / "docs")], TOK, root / "corpus", val_fraction=0.5, progress=False)
    return root


@dataclass
class Env:
    root: Path  # a fresh copy of the fixture
    monkeypatch: pytest.MonkeyPatch
    saved: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> str:
        return str(self.root / name)


_PROGRESS = re.compile(r"\[\d\d:\d\d|\d%\||/s\]|/s, ")  # tqdm's timer, bar and rate


def messages(err: str) -> list[str]:
    """What a command printed on stderr besides its progress bars (tqdm redraws them with \\r):
    its `note: ...`, `error: ...` or `interrupted` lines."""
    parts = (part.strip() for part in re.split(r"[\r\n]", err))
    return [part for part in parts if part and not _PROGRESS.search(part)]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root (hidden ones too): its SHA-256, or "dir"."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def hidden_leftovers(root: Path) -> list[str]:
    """Temporary files and folders of a write (hidden names) anywhere under root."""
    return [str(p.relative_to(root)) for p in root.rglob(".*")]


# ---- setups ---------------------------------------------------------------------------------------
def nothing(env: Env) -> None:
    """No setup."""


def chain(*steps: Callable[[Env], None]) -> Callable[[Env], None]:
    def run(env: Env) -> None:
        for step in steps:
            step(env)

    return run


def write(name: str, data: bytes | str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        path = env.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def exported(name: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        assert main(["export", env["model"], env[name]]) == 0

    return setup


def saved_model(name: str) -> Callable[[Env], None]:
    """Another model directory, written by save_pretrained (not by an export)."""

    def setup(env: Env) -> None:
        torch.manual_seed(1)
        TransformerForCausalLM(TransformerConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2)).save_pretrained(
            env.root / name, tokenizer=TOK
        )

    return setup


def foreign_tokenizer(name: str) -> Callable[[Env], None]:
    """GPT-2's tokenizer.json (50,259 tokens) in a 300-token model directory, checksums.json gone."""

    def setup(env: Env) -> None:
        load_tokenizer("gpt2").save(env.root / name)
        (env.root / name / "checksums.json").unlink()

    return setup


def tokenizer_folder(name: str) -> Callable[[Env], None]:
    """A folder holding a tokenizer.json alone, as `farsight data train-tokenizer` writes it."""

    def setup(env: Env) -> None:
        TOK.save(env.root / name)

    return setup


SFT = "".join(json.dumps({"prompt": f"question {i}?", "completion": f" answer {i}"}) + "\n" for i in range(8))


def disk_full_in(target: str, attribute: str) -> Callable[[Env], None]:
    """`target.attribute` (a function that writes) fails with ENOSPC."""

    def setup(env: Env) -> None:
        def full(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        env.monkeypatch.setattr(f"{target}.{attribute}", full)

    return setup


def interrupted_in(target: str, attribute: str) -> Callable[[Env], None]:
    """Ctrl-C while `target.attribute` runs."""

    def setup(env: Env) -> None:
        def stop(*args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

        env.monkeypatch.setattr(f"{target}.{attribute}", stop)

    return setup


def json_write_cut(error: BaseException) -> Callable[[Env], None]:
    """An --out JSON write that stops halfway (`error`: Ctrl-C or a full disk), through the real
    atomic_write."""

    def setup(env: Env) -> None:
        import farsight.eval.efficiency as efficiency
        from farsight.files import atomic_write

        def cut(path: Path, writer: Callable[[str], None]) -> None:
            def half(tmp: str) -> None:
                Path(tmp).write_text('{"results": ')
                raise error

            atomic_write(path, half)

        env.monkeypatch.setattr(efficiency, "atomic_write", cut)

    return setup


# ---- checks ----------------------------------------------------------------------------------------
def loads(name: str) -> Callable[[Env], None]:
    def check(env: Env) -> None:
        load_model(env.root / name)
        assert not hidden_leftovers(env.root)

    return check


def holds_model_of(name: str, source: str) -> Callable[[Env], None]:
    """`name` is now an export of `source` (same weights), and nothing is left beside it."""

    def check(env: Env) -> None:
        ours, theirs = load_model(env.root / name), load_model(env.root / source)
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
        assert not hidden_leftovers(env.root)

    return check


def prepared(name: str, documents: int) -> Callable[[Env], None]:
    def check(env: Env) -> None:
        meta = json.loads((env.root / name / "meta.json").read_text())
        assert sum(s["documents"] for s in meta["splits"].values()) == documents
        assert not hidden_leftovers(env.root)

    return check


@dataclass(frozen=True)
class Case:
    name: str
    setup: Callable[[Env], None]
    argv: Callable[[Env], list[str]]
    error: str | None  # regex for the text after "error: "; None: the command succeeds
    code: int | None = None  # the exit code: 2 with an error, else 0 unless given (130: interrupted)
    keeps: Callable[[Env], None] | None = None  # None with an error: every file stays as it was
    note: str | None = None  # regex of a `note: ...` line the command must print on stderr
    needs: str | None = None  # a module the case needs (skipped without it)


def export(*args: str) -> Callable[[Env], list[str]]:
    return lambda env: [
        "export",
        *(a.format(**{k: env[k] for k in ("model", "run", "drt")}, root=env.root) for a in args),
    ]


def command(*args: str) -> Callable[[Env], list[str]]:
    """argv with {root} standing for the fixture copy."""
    return lambda env: [a.format(root=env.root) for a in args]


CKPT = "{run}/checkpoints/step_00000040"
PASSKEY = ("eval", "passkey", "--model", "{root}/drt", "--filler", "repeat", "--depths", "0.5", "--trials", "1")
PPL = ("eval", "ppl", "--model", "{root}/drt", "--corpus", "{root}/corpus", "--lengths", "32", "--windows", "1")
PREPARE = ("data", "prepare", "--source", "{root}/docs", "--out", "{root}/new/corpus")
GENERATE = ("generate", "--model", "{root}/model", "--max-new-tokens", "2")

CASES = [
    # ---- export: nothing it may not overwrite is overwritten ------------------------------------
    Case("export onto its own source", nothing, export(CKPT, CKPT), r"is the model being exported; export to a new"),
    Case("export of a run into itself", nothing, export("{run}", "{run}"), r"is the model being exported or holds it"),
    Case(
        "export into a run's checkpoints",
        nothing,
        export("{model}", "{run}/checkpoints/exported"),
        r"is inside the checkpoints of the run .*run, where farsight keeps its own files",
    ),
    Case(
        "export onto another run's checkpoint",
        nothing,
        export("{model}", CKPT),
        r"inside the checkpoints of the run",
    ),
    Case("export onto a run", nothing, export("{model}", "{run}"), r"is a training run or checkpoint"),
    Case(
        "export into the source",
        nothing,
        export("{model}", "{model}/copy"),
        r"is inside the model being exported",
    ),
    Case(
        "export onto a folder of notes",
        write("notes/todo.txt", "mine"),
        export("{model}", "{root}/notes"),
        r"notes exists and is not a model directory \(it holds todo\.txt\); export to a new or empty folder",
    ),
    Case(
        "export onto a model no export wrote",
        saved_model("other"),
        export("{model}", "{root}/other"),
        r"holds a model that no export wrote; pass --force",
    ),
    Case(
        "export onto a model no export wrote, --force",
        saved_model("other"),
        export("{model}", "{root}/other", "--force"),
        None,
        keeps=holds_model_of("other", "model"),
    ),
    Case(
        "export onto a previous export",
        exported("out"),
        export("{drt}", "{root}/out"),
        None,
        keeps=holds_model_of("out", "drt"),
    ),
    Case(
        "export onto a file",
        write("file.txt", "x"),
        export("{model}", "{root}/file.txt"),
        r"file\.txt is a file; export to a new or empty folder",
    ),
    Case(
        "export, disk full",
        disk_full_in("shutil", "copyfile"),
        export("{model}", "{root}/a/b/out"),
        r"disk full at .*a/b/out \(No space left on device\); free some space",
    ),
    Case(
        "export, Ctrl-C",
        interrupted_in("farsight.models.registry", "write_checksums"),
        export("{model}", "{root}/a/out"),
        None,
        code=130,
    ),
    Case(
        "export of a model with another model's tokenizer",
        foreign_tokenizer("model"),
        export("{model}", "{root}/out"),
        r"tokenizer\.json has 50,259 tokens but the model in .* has a vocabulary of 300.*own tokenizer\.json",
    ),
    Case(
        "export onto a dataset",
        nothing,
        export("{model}", "{root}/corpus"),
        r"corpus exists and is not a model directory \(it holds a prepared dataset\); export to a new or empty folder",
    ),
    # ---- every command that writes a folder: a dataset replaces a dataset, anything else needs --force
    Case(
        "data prepare onto a model",
        nothing,
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/model"),
        r"^error: --out .*/model holds a model, not a prepared dataset, and writing there would replace or mix with "
        r"its files; pass a new or empty folder, or --force \(overwrite=True\) to write there anyway$",
    ),
    Case(
        "data prepare onto a model, --force",
        nothing,
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/model", "--force"),
        None,
        keeps=prepared("model", 4),
    ),
    Case(
        "data prepare onto a trained tokenizer",
        tokenizer_folder("tok"),
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/tok"),
        r"--out .*/tok holds a tokenizer, not a prepared dataset",
    ),
    Case(
        "data prepare onto a run",
        nothing,
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/run"),
        r"--out .*/run holds a training run, not a prepared dataset",
    ),
    Case(
        "data prepare onto a folder of notes",
        write("notes/todo.txt", "mine"),
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/notes"),
        r"--out .*/notes holds other files \(todo\.txt\), not a prepared dataset",
    ),
    Case(
        "data prepare-sft onto a model",
        write("sft.jsonl", SFT),
        command("data", "prepare-sft", "--source", "{root}/sft.jsonl", "--out", "{root}/model"),
        r"--out .*/model holds a model, not a prepared dataset",
    ),
    Case(
        "data train-tokenizer onto a model",
        nothing,
        command("data", "train-tokenizer", "--source", "{root}/docs", "--vocab-size", "270", "--out", "{root}/model"),
        r"--out .*/model holds a model, not a tokenizer",
    ),
    Case(
        "data train-tokenizer onto a dataset",
        nothing,
        command("data", "train-tokenizer", "--source", "{root}/docs", "--vocab-size", "270", "--out", "{root}/corpus"),
        r"--out .*/corpus holds a prepared dataset, not a tokenizer",
    ),
    Case(
        "passkey --export-choice onto a model",
        nothing,
        command(*PASSKEY, "--lengths", "200", "--export-choice", "{root}/model"),
        r"--export-choice .*/model holds a model, not exported lm-eval tasks",
    ),
    Case(
        "ruler --export onto a folder of notes",
        write("notes/todo.txt", "mine"),
        command("eval", "ruler", "--tasks", "vt", "--lengths", "1k", "--tokenizer", "byte", "--export", "{root}/notes"),
        r"--export .*/notes holds other files \(todo\.txt\), not exported lm-eval tasks",
    ),
    Case(
        "demo --out onto a dataset",
        nothing,
        command("demo", "--model", "{root}/drt", "--out", "{root}/corpus"),
        r"--out .*/corpus holds a prepared dataset, not demo results",
    ),
    # ---- a model and its tokenizer ----------------------------------------------------------------
    Case(
        "generate with another model's tokenizer",
        foreign_tokenizer("model"),
        command(*GENERATE),
        r"has 50,259 tokens but the model in .* has a vocabulary of 300",
    ),
    Case(
        "passkey with another model's tokenizer",
        foreign_tokenizer("drt"),
        command(*PASSKEY, "--lengths", "200"),
        r"has 50,259 tokens but the model in .* has a vocabulary of 300",
    ),
    # ---- numbers ----------------------------------------------------------------------------------
    Case("generate --seed -1", nothing, command(*GENERATE, "--seed", "-1"), r"--seed must be at least 0, got -1"),
    Case(
        "generate --seed 2**64",
        nothing,
        command(*GENERATE, "--seed", str(2**64)),
        r"--seed must be at most 9223372036854775807",
    ),
    Case(
        "generate --max-new-tokens -1",
        nothing,
        command(*GENERATE, "--max-new-tokens", "-1"),
        r"--max-new-tokens must be at least 0",
    ),
    Case(
        "generate --temperature nan",
        nothing,
        command(*GENERATE, "--temperature", "nan"),
        r"--temperature must be a finite number of at least 0, got nan",
    ),
    Case("generate --top-p 0", nothing, command(*GENERATE, "--top-p", "0"), r"--top-p must be in \(0, 1\], got 0"),
    Case("generate --top-k 0", nothing, command(*GENERATE, "--top-k", "0"), r"--top-k must be at least 1, got 0"),
    Case("data prepare --seed -1", nothing, command(*PREPARE, "--seed", "-1"), r"--seed must be at least 0, got -1"),
    Case(
        "data prepare --val-fraction nan",
        nothing,
        command(*PREPARE, "--val-fraction", "nan"),
        r"--val-fraction must be in \(0, 1\], got nan",
    ),
    Case(
        "data prepare --val-fraction 1",
        nothing,
        command(*PREPARE, "--val-fraction", "1"),
        r"--val-fraction must be below 1",
    ),
    Case(
        "--choices without --export-choice",
        nothing,
        command(*PASSKEY, "--lengths", "200", "--choices", "3"),
        r"--choices 3 sets the choices per item of --export-choice; add --export-choice DIR or drop --choices",
    ),
    Case(
        "passkey --lengths 1e12 --allow-long",
        nothing,
        command(*PASSKEY, "--lengths", "1e12", "--allow-long"),
        r"--lengths 1,000,000,000,000 needs about \d+\.\d TB of memory \(haystacks: .* more than the .* available; "
        r"pass shorter --lengths",
    ),
    Case(
        "ruler --lengths 1e12 --allow-long",
        nothing,
        command("eval", "ruler", "--model", "{root}/drt", "--tasks", "vt", "--lengths", "1e12", "--allow-long"),
        r"needs about \d+\.\d TB of memory",
    ),
    Case(
        "harness --limit nan",
        nothing,
        command("eval", "harness", "--model", "{root}/drt", "--tasks", "x", "--limit", "nan"),
        r"--limit must be > 0, got nan",
    ),
    Case(
        "harness --limit 2.5",
        nothing,
        command("eval", "harness", "--model", "{root}/drt", "--tasks", "x", "--limit", "2.5"),
        r"a count of examples is a whole number",
    ),
    # ---- files farsight reads -------------------------------------------------------------------
    Case(
        "data prepare of a folder without text files",
        write("logs/a.log", "a log line\n" * 20),
        command("data", "prepare", "--source", "{root}/logs", "--out", "{root}/new"),
        r"no files with extensions .* under .*logs; .*`farsight data prepare --extensions \.log,\.csv`",
    ),
    Case(
        "data prepare --extensions .log",
        chain(write("logs/a.log", "one log line\n" * 20), write("logs/b.log", "another line\n" * 20)),
        command("data", "prepare", "--source", "{root}/logs", "--out", "{root}/new", "--extensions", ".log"),
        None,
        keeps=prepared("new", 2),
    ),
    Case(
        "data prepare of invalid UTF-8 warns",
        write("docs/bad.txt", b"caf\xe9 au lait \xff\xfe and more text " * 3),
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/new"),
        None,
        keeps=prepared("new", 5),
        note=r"bad\.txt: 9 bytes not valid UTF-8, read as U\+FFFD",
    ),
    Case(
        "retrieval --text of an empty file",
        write("empty.txt", ""),
        command("eval", "retrieval", "--model", "{root}/drt", "--text", "{root}/empty.txt"),
        r"--text .*empty\.txt holds 0 tokens; .* needs at least 16: pass a longer text",
    ),
    Case(
        "retrieval --text of invalid UTF-8 warns",
        write("bad.txt", b"\xff" + b"a long enough text of words " * 4),
        command("eval", "retrieval", "--model", "{root}/drt", "--text", "{root}/bad.txt"),
        None,
        keeps=lambda env: None,
        note=r"bad\.txt: 1 byte not valid UTF-8, read as U\+FFFD",
    ),
    Case(
        "generate --prompt with bytes that are not UTF-8",  # Python hands them over as lone surrogates
        nothing,
        command(*GENERATE, "--prompt", "caf\udce9"),
        None,
        keeps=lambda env: None,
        note=r"--prompt: 1 byte not valid UTF-8, read as U\+FFFD",
    ),
    Case(
        "harness task whose data file is missing",
        write(
            "tasks/mine.yaml", "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: gone.jsonl\n"
        ),
        command("eval", "harness", "--model", "{root}/drt", "--tasks", "mine", "--include-path", "{root}/tasks"),
        r"mine\.yaml: its data file gone\.jsonl does not exist; a relative path is read from the working directory",
        needs="lm_eval",
    ),
    # ---- disk full and Ctrl-C on every write path -------------------------------------------------
    Case(
        "data prepare, disk full",
        disk_full_in("farsight.data.token_files._SplitWriter", "write"),
        command(*PREPARE),
        r"disk full at .*new/corpus \(No space left on device\); free some space",
    ),
    Case(
        "data prepare onto a dataset, disk full",
        disk_full_in("farsight.data.token_files._SplitWriter", "write"),
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/corpus", "--seed", "3"),
        r"disk full at .*corpus \(No space left on device\)",
    ),
    Case(
        "data prepare, Ctrl-C",
        interrupted_in("farsight.data.tokenizers.ByteTokenizer", "encode_batch"),
        command(*PREPARE),
        None,
        code=130,
    ),
    Case(
        "data prepare onto a dataset, Ctrl-C",
        interrupted_in("farsight.data.tokenizers.ByteTokenizer", "encode_batch"),
        command("data", "prepare", "--source", "{root}/docs", "--out", "{root}/corpus", "--seed", "3"),
        None,
        code=130,
    ),
    Case(
        "eval ppl, Ctrl-C",
        interrupted_in("farsight.eval.perplexity", "evaluate_perplexity"),
        command(*PPL, "--out", "{root}/results/ppl.json"),
        None,
        code=130,
    ),
    Case(
        "eval ppl, Ctrl-C while --out is written",
        json_write_cut(KeyboardInterrupt()),
        command(*PPL, "--out", "{root}/results/ppl.json"),
        None,
        code=130,
    ),
    Case(
        "eval ppl, disk full while --out is written",
        json_write_cut(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
        command(*PPL, "--out", "{root}/results/ppl.json"),
        r"disk full at .*results/ppl\.json \(No space left on device\)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_cli_case(case: Case, fixture_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    if case.needs:
        pytest.importorskip(case.needs)
    env = Env(root=tmp_path / "w", monkeypatch=monkeypatch)
    shutil.copytree(fixture_root, env.root, symlinks=True)
    case.setup(env)
    before = snapshot(env.root)
    capsys.readouterr()
    code = main(case.argv(env))
    err = capsys.readouterr().err
    assert code == (case.code if case.code is not None else 2 if case.error else 0), err
    printed = messages(err)
    lines = [line for line in printed if not line.startswith("note: ")]
    if case.error is not None:
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert re.search(case.error, lines[0]), lines[0]
    elif case.code == 130:
        assert lines[-1:] == ["interrupted"] and "Traceback" not in err, err
    else:
        assert "error" not in err, err
    if case.note is not None:
        assert any(re.search(case.note, line) for line in printed if line.startswith("note: ")), err
    if case.keeps is not None:
        case.keeps(env)
    elif case.error is not None or case.code:
        assert snapshot(env.root) == before  # nothing lost, changed or left behind


LOCKED_WRITES = {
    "data prepare": ("data", "prepare", "--source", "{root}/docs", "--out", "{out}"),
    "data prepare-sft": ("data", "prepare-sft", "--source", "{root}/sft.jsonl", "--out", "{out}"),
    "data train-tokenizer": (
        "data",
        "train-tokenizer",
        "--source",
        "{root}/docs",
        "--vocab-size",
        "270",
        "--out",
        "{out}",
    ),
    "export": ("export", "{root}/model", "{out}"),
    "ruler --export": ("eval", "ruler", "--tasks", "vt", "--lengths", "1k", "--tokenizer", "byte", "--export", "{out}"),
    "passkey --export-choice": (*PASSKEY, "--lengths", "200", "--export-choice", "{out}"),
}


@pytest.mark.parametrize("argv", LOCKED_WRITES.values(), ids=LOCKED_WRITES.keys())
def test_a_folder_another_process_writes_is_refused_in_one_line(
    argv: tuple[str, ...], fixture_root: Path, tmp_path: Path, capsys
) -> None:
    """While a folder is being written (its lock held, here by this process), a second command
    writing it is refused naming the writer, and leaves everything as it was."""
    from farsight.files import folder_lock

    root = tmp_path / "w"
    shutil.copytree(fixture_root, root, symlinks=True)
    (root / "sft.jsonl").write_text(SFT)
    out = root / "out"
    with folder_lock(out, "farsight data prepare"):
        before = snapshot(root)
        capsys.readouterr()
        assert main([a.format(root=root, out=out) for a in argv]) == 2
        err = messages(capsys.readouterr().err)
        assert snapshot(root) == before
    assert len(err) == 1 and re.match(
        rf"error: {re.escape(str(out))} is being written by farsight data prepare \(pid {os.getpid()} on .*, since .*\); "
        r"wait for it to end, or \w+",
        err[0],
    ), err
    assert snapshot(root) == {k: v for k, v in before.items() if k != ".out.lock"}


def test_an_exported_task_folder_runs_where_it_is_moved_and_an_old_one_says_to_export_again(
    fixture_root: Path, tmp_path: Path, capsys
) -> None:
    """Exported lm-eval tasks read their items relative to their folder; a folder exported with
    absolute paths (an older farsight) and moved is refused in one line."""
    pytest.importorskip("lm_eval")
    drt = str(fixture_root / "drt")
    grid = ["--filler", "repeat", "--lengths", "120", "--depths", "0.5", "--trials", "2", "--align", "1"]
    assert main(["eval", "passkey", "--model", drt, *grid, "--export-choice", str(tmp_path / "tasks")]) == 0
    (tmp_path / "tasks").rename(tmp_path / "moved")
    harness = ["eval", "harness", "--model", drt, "--tasks", "farsight_passkey_mc_120", "--include-path"]
    capsys.readouterr()
    assert main([*harness, str(tmp_path / "moved")]) == 0
    assert "farsight_passkey_mc_120" in capsys.readouterr().out
    # the older layout: an absolute data path, read by lm-eval's json loader
    yaml_file = tmp_path / "moved" / "farsight_passkey_mc_120.yaml"
    text = yaml_file.read_text().replace("custom_dataset: !function farsight_data.load\n", "")
    yaml_file.write_text(
        text.replace("data/farsight_passkey_mc_120.jsonl", str(tmp_path / "tasks" / "data" / "x.jsonl"))
    )
    assert main([*harness, str(tmp_path / "moved")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.search(
        r"its data file .*x\.jsonl does not exist; the folder was moved .*export the tasks again", err[0]
    )


def test_harness_help_says_include_path_runs_code(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "harness", "--help"])
    assert "!function" in capsys.readouterr().out


# ---- a real full disk: a small tmpfs ----------------------------------------------------------------
@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (made), unmounted after; skips where root cannot mount one."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


TMPFS_CASES = [
    # (name, size of the tmpfs, argv with {disk} for its mount point and {root} for the fixture copy)
    ("export", "64k", ("export", "{root}/model", "{disk}/sub/out")),
    ("data prepare", "256k", ("data", "prepare", "--source", "{root}/big", "--out", "{disk}/corpus")),
    (
        "eval ppl --out",
        "4k",
        (
            "eval",
            "ppl",
            "--model",
            "{root}/drt",
            "--corpus",
            "{root}/corpus",
            "--lengths",
            "32",
            "--windows",
            "1",
            "--out",
            "{disk}/results/ppl.json",
        ),
    ),
]


@pytest.mark.parametrize("size, argv", [pytest.param(*case[1:], id=case[0]) for case in TMPFS_CASES])
def test_a_real_full_disk_is_one_line_and_leaves_nothing(
    size: str, argv: tuple[str, ...], fixture_root: Path, tmp_path: Path, capsys
) -> None:
    root = tmp_path / "w"
    shutil.copytree(fixture_root, root, symlinks=True)
    (root / "big").mkdir()
    for i in range(3):
        (root / "big" / f"b{i}.txt").write_text(f"{i} " + TEXT * 40)  # ~200K tokens: 400 KB of uint16
    before = snapshot(root)
    with tmpfs(tmp_path / "disk", size) as disk:
        if "ppl" in argv:  # fill the disk but for a few bytes: the results file cannot fit
            (disk / "filler").write_bytes(b"x" * 4096)
        filled = snapshot(disk)
        capsys.readouterr()
        code = main([a.format(root=root, disk=disk) for a in argv])
        err = messages(capsys.readouterr().err)
        assert code == 2 and len(err) == 1 and re.search(r"^error: disk full at .*No space left on device", err[0]), err
        assert snapshot(disk) == filled  # no partial file, temporary file or empty folder left on the full disk
    assert snapshot(root) == before
