"""Every bad CLI argument, task option or untrusted input is refused with one line before any work:
each case is (name, argv built from the fixture paths, expected part of the error line)."""

import os
from pathlib import Path

import pytest
import torch

from farsight.cli import main
from farsight.data.token_files import prepare_corpus
from farsight.data.tokenizers import load_tokenizer, train_bpe_tokenizer
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM

TOK = load_tokenizer("byte")
TEXTS = [(f"alpha beta gamma delta {i} ") * (40 + 30 * i) for i in range(6)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    torch.manual_seed(0)
    DRTForCausalLM(
        DRTConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, chunk_size=8, window=16, top_k=2, encoder_layers=1)
    ).save_pretrained(root / "drt", tokenizer=TOK)
    TransformerForCausalLM(
        TransformerConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, attention="sliding", window=16)
    ).save_pretrained(root / "tf", tokenizer=TOK)
    docs = root / "docs"
    docs.mkdir()
    for i, text in enumerate(TEXTS):
        (docs / f"d{i}.txt").write_text(text)
    prepare_corpus([str(docs)], TOK, root / "byte", val_fraction=0.5, progress=False)
    prepare_corpus(
        [str(docs)], train_bpe_tokenizer(TEXTS * 5, vocab_size=290), root / "bpe", val_fraction=0.5, progress=False
    )
    good = '{"prompt": "alpha beta", "completion": " gamma"}\n'
    (root / "good.jsonl").write_text(good * 3)
    (root / "bad.jsonl").write_text(good + '{"prompt": "alpha", "completion": ""}\n')
    return {
        "root": root,
        "good": str(root / "good.jsonl"),
        "bad": str(root / "bad.jsonl"),
        "drt": str(root / "drt"),
        "tf": str(root / "tf"),
        "byte": str(root / "byte"),
        "bpe": str(root / "bpe"),
        "file": str(docs / "d0.txt"),
    }


def passkey(p, *extra, task="passkey"):
    return [
        "eval",
        task,
        "--model",
        p["drt"],
        "--filler",
        "repeat",
        "--lengths",
        "200",
        "--depths",
        "0.5",
        "--trials",
        "1",
        *extra,
    ]


def ppl(p, *extra, corpus="byte"):
    return [
        "eval",
        "ppl",
        "--model",
        p["drt"],
        "--corpus",
        p[corpus],
        "--lengths",
        "64",
        "--windows",
        "2",
        "--batch-size",
        "2",
        *extra,
    ]


def retrieval(p, *extra, corpus="byte"):
    return ["eval", "retrieval", "--model", p["drt"], "--corpus", p[corpus], *extra]


def demo(p, *extra, model="drt"):
    return [
        "demo",
        "--model",
        p[model],
        "--corpus",
        p["byte"],
        "--lengths",
        "200",
        "--depths",
        "0.5",
        "--trials",
        "1",
        *extra,
    ]


def out(p, name):
    return str(p["root"] / "results" / name)


def generate(p, *extra, data="good"):
    return ["eval", "generate", "--model", p["drt"], "--data", p[data], "--max-new-tokens", "2", *extra]


def prepare_sft(p, *extra):
    return ["data", "prepare-sft", "--source", p["good"], *extra]


CASES = [
    ("generate --out in a file", lambda p: generate(p, "--out", p["file"] + "/r.json"), "d0.txt is not a folder"),
    (
        "generate --data missing",
        lambda p: generate(p, "--data", str(p["root"] / "missing.jsonl")),
        "missing.jsonl does not exist",
    ),
    (
        "generate --max-new-tokens 0",
        lambda p: generate(p, "--max-new-tokens", "0"),
        "--max-new-tokens must be at least 1",
    ),
    ("generate --buckets x", lambda p: generate(p, "--buckets", "2k,x"), "--buckets='2k,x' is not a comma-separated"),
    ("generate a bad record", lambda p: generate(p, data="bad"), "bad.jsonl:2: empty completion"),
    ("prepare-sft --out is a file", lambda p: prepare_sft(p, "--out", p["file"]), "d0.txt is not a folder"),
    (
        "prepare-sft --max-len 1",
        lambda p: prepare_sft(p, "--out", out(p, "sft"), "--max-len", "1"),
        "--max-len must be at least 2",
    ),
    (
        "prepare-sft --val-fraction 1",
        lambda p: prepare_sft(p, "--out", out(p, "sft"), "--val-fraction", "1"),
        "--val-fraction must be below 1",
    ),
    (
        "prepare-sft --val missing",
        lambda p: prepare_sft(p, "--out", out(p, "sft"), "--val", str(p["root"] / "nope.jsonl")),
        "nope.jsonl does not exist",
    ),
    ("ppl --out in a file", lambda p: ppl(p, "--out", p["file"] + "/r.json"), "d0.txt is not a folder"),
    ("ppl --plot in a file", lambda p: ppl(p, "--plot", p["file"] + "/p.png"), "d0.txt is not a folder"),
    ("ppl --plot .txt", lambda p: ppl(p, "--plot", out(p, "p.txt")), "matplotlib cannot write .txt files; use one of"),
    ("passkey --plot .txt", lambda p: passkey(p, "--plot", out(p, "p.txt")), "matplotlib cannot write .txt files"),
    (
        "compare --plot .foo",
        lambda p: ["eval", "compare", p["file"], "--plot", out(p, "c.foo")],
        "matplotlib cannot write .foo files",
    ),
    ("ppl --out a folder", lambda p: ppl(p, "--out", str(p["root"])), "is a folder; pass a file path"),
    ("passkey --out in a file", lambda p: passkey(p, "--out", p["file"] + "/r.json"), "d0.txt is not a folder"),
    ("passkey --plot in a file", lambda p: passkey(p, "--plot", p["file"] + "/p.png"), "d0.txt is not a folder"),
    ("retrieval --out in a file", lambda p: retrieval(p, "--out", p["file"] + "/r.json"), "d0.txt is not a folder"),
    (
        "compare --plot in a file",
        lambda p: ["eval", "compare", p["file"], "--plot", p["file"] + "/c.png"],
        "d0.txt is not a folder",
    ),
    ("demo --out is a file", lambda p: demo(p, "--out", p["file"]), "d0.txt is not a folder"),
    (
        "data prepare --out is a file",
        lambda p: ["data", "prepare", "--source", str(p["root"] / "docs"), "--out", p["file"]],
        "d0.txt is not a folder",
    ),
    (
        "--lengths inf",
        lambda p: passkey(p, "--lengths", "inf", "--out", out(p, "r.json")),
        "must be a positive whole number",
    ),
    (
        "--lengths nan",
        lambda p: passkey(p, "--lengths", "nan", "--out", out(p, "r.json")),
        "must be a positive whole number",
    ),
    (
        "--lengths 0",
        lambda p: passkey(p, "--lengths", "0", "--out", out(p, "r.json")),
        "must be a positive whole number",
    ),
    ("--lengths 1e9", lambda p: passkey(p, "--lengths", "1e9", "--out", out(p, "r.json")), "pass --allow-long"),
    ("ppl --lengths 1e9", lambda p: ppl(p, "--lengths", "1e9", "--out", out(p, "r.json")), "pass --allow-long"),
    ("demo --lengths 1e9", lambda p: demo(p, "--lengths", "1e9", "--out", out(p, "demo")), "pass --allow-long"),
    ("ppl --lengths 1", lambda p: ppl(p, "--lengths", "1", "--out", out(p, "r.json")), "at least 2 tokens"),
    (
        "--depths 0,2",
        lambda p: passkey(p, "--depths", "0,2", "--out", out(p, "r.json")),
        "--depths 2.0 is outside [0, 1]",
    ),
    ("--trials 0", lambda p: passkey(p, "--trials", "0", "--out", out(p, "r.json")), "trials must be >= 1"),
    (
        "passkey --seed -1",
        lambda p: passkey(p, "--seed", "-1", "--out", out(p, "r.json")),
        "--seed must be at least 0, got -1",
    ),
    ("ppl --seed -1", lambda p: ppl(p, "--seed", "-1", "--out", out(p, "r.json")), "--seed must be at least 0, got -1"),
    (
        "passkey --batch-size 0",
        lambda p: passkey(p, "--batch-size", "0", "--out", out(p, "r.json")),
        "--batch-size must be at least 1",
    ),
    (
        "passkey --align -1",
        lambda p: passkey(p, "--align", "-1", "--out", out(p, "r.json")),
        "--align must be at least 1",
    ),
    (
        "ppl --batch-size 0",
        lambda p: ppl(p, "--batch-size", "0", "--out", out(p, "r.json")),
        "--batch-size must be at least 1",
    ),
    ("ppl --windows 0", lambda p: ppl(p, "--windows", "0", "--out", out(p, "r.json")), "--windows must be at least 1"),
    (
        "ppl --windows 10000",
        lambda p: ppl(p, "--windows", "10000", "--out", out(p, "r.json")),
        "disjoint windows of 64 tokens, fewer than the 10000",
    ),
    (
        "ppl --window-length abc",
        lambda p: ppl(p, "--window-length", "abc", "--out", out(p, "r.json")),
        "--window-length 'abc' is not a length",
    ),
    (
        "ppl --window-length < lengths",
        lambda p: ppl(p, "--window-length", "32", "--out", out(p, "r.json")),
        "shorter than the longest evaluation length 64",
    ),
    (
        "demo --batch-size 0",
        lambda p: demo(p, "--batch-size", "0", "--out", out(p, "demo")),
        "--batch-size must be at least 1",
    ),
    (
        "unknown --task-option",
        lambda p: passkey(p, "--task-option", "colour=red", "--out", out(p, "r.json")),
        "colour not valid for the passkey task",
    ),
    (
        "--task-option without =",
        lambda p: passkey(p, "--task-option", "digits", "--out", out(p, "r.json")),
        "expects KEY=VALUE",
    ),
    (
        "--task-option digits=0",
        lambda p: passkey(p, "--task-option", "digits=0", "--out", out(p, "r.json")),
        "digits must be a whole number >= 1",
    ),
    (
        "--task-option digits=abc",
        lambda p: passkey(p, "--task-option", "digits=abc", "--out", out(p, "r.json")),
        "digits must be a whole number >= 1",
    ),
    (
        "multikey keys=0",
        lambda p: passkey(p, "--task-option", "keys=0", "--out", out(p, "r.json"), task="multikey"),
        "keys must be a whole number >= 1",
    ),
    (
        "niah2hop symbol=0",
        lambda p: passkey(p, "--task-option", "symbol=0", "--out", out(p, "r.json"), task="niah2hop"),
        "symbol must be a whole number >= 1",
    ),
    (
        "niah2hop distractors=-1",
        lambda p: passkey(p, "--task-option", "distractors=-1", "--out", out(p, "r.json"), task="niah2hop"),
        "distractors must be",
    ),
    (
        "retrieval --text a folder",
        lambda p: [
            "eval",
            "retrieval",
            "--model",
            p["drt"],
            "--text",
            str(p["root"] / "docs"),
            "--out",
            out(p, "r.json"),
        ],
        "docs is a folder; pass a text file",
    ),
    (
        "retrieval --document 99",
        lambda p: retrieval(p, "--document", "99", "--out", out(p, "r.json")),
        "--document 99 does not exist",
    ),
    (
        "retrieval --document -1",
        lambda p: retrieval(p, "--document", "-1", "--out", out(p, "r.json")),
        "--document must be at least 0",
    ),
    (
        "retrieval --max-tokens 0",
        lambda p: retrieval(p, "--max-tokens", "0", "--out", out(p, "r.json")),
        "--max-tokens must be at least 1",
    ),
    (
        "demo of a transformer",
        lambda p: demo(p, "--out", out(p, "demo"), model="tf"),
        "is a TransformerForCausalLM; pass a DRT",
    ),
    (
        "ppl corpus of another tokenizer",
        lambda p: ppl(p, "--out", out(p, "r.json"), corpus="bpe"),
        "prepared with another tokenizer",
    ),
    (
        "retrieval corpus of another tokenizer",
        lambda p: retrieval(p, "--out", out(p, "r.json"), corpus="bpe"),
        "prepared with another tokenizer",
    ),
    (
        "needle filler of another tokenizer",
        lambda p: passkey(p, "--filler", "corpus", "--corpus", p["bpe"], "--out", out(p, "r.json")),
        "another tokenizer",
    ),
]


@pytest.mark.parametrize("argv, expected", [pytest.param(argv, expected, id=name) for name, argv, expected in CASES])
def test_refused_with_one_line_before_any_work(paths, capsys, argv, expected):
    before = sorted(p.relative_to(paths["root"]) for p in paths["root"].rglob("*"))
    assert main(argv(paths)) == 2
    captured = capsys.readouterr()
    assert (
        captured.err.startswith("error: ") and len(captured.err.strip().splitlines()) == 1 and expected in captured.err
    )
    assert captured.out == ""  # no results table: nothing was evaluated
    assert sorted(p.relative_to(paths["root"]) for p in paths["root"].rglob("*")) == before


def _outside(src: Path) -> None:
    (src.parent / "secret.txt").write_text("secret " * 30)
    (src / "secret.txt").symlink_to(src.parent / "secret.txt")


def _inside(src: Path) -> None:
    (src / "a").mkdir()
    (src / "a" / "same.txt").symlink_to(src / "d0.txt")


PREPARE_CASES = [
    ("FIFO", lambda src: os.mkfifo(src / "pipe.txt"), "pipe.txt: not a regular file", 3),
    ("link outside the tree", _outside, "secret.txt: it links to", 3),
    ("dangling link", lambda src: (src / "gone.txt").symlink_to(src / "nothing.txt"), "gone.txt: dangling link", 3),
    (
        "link to a folder",
        lambda src: (src / "elsewhere").symlink_to(src.parent, target_is_directory=True),
        "links to folders are not followed",
        3,
    ),
    ("link inside the tree", _inside, None, 4),
]


@pytest.mark.parametrize("setup, note, documents", [pytest.param(*case[1:], id=case[0]) for case in PREPARE_CASES])
def test_prepare_reads_regular_files_inside_the_tree_only(tmp_path, capsys, setup, note, documents):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(f"document {i} " * 20)
    setup(src)
    assert main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == ([] if note is None else [line for line in notes if note in line]) and len(notes) == (
        note is not None
    )
    assert main(["data", "info", str(tmp_path / "out")]) == 0
    assert f'"documents": {documents}' in capsys.readouterr().out


def test_the_tokenizer_fix_for_a_training_run_prepares_a_corpus_it_can_score(paths, capsys, tmp_path):
    """A corpus of another tokenizer is refused with a `data prepare --tokenizer RUN` command, and
    that command (a run directory, not a model directory) prepares one with the run's tokenizer."""
    from farsight.data.token_files import load_token_dataset

    bpe = load_token_dataset(paths["bpe"], "train").tokenizer
    run = tmp_path / "run"
    TransformerForCausalLM(TransformerConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2)).save_pretrained(
        run / "checkpoints" / "step_00000002", tokenizer=bpe
    )
    score = ["eval", "ppl", "--model", str(run), "--lengths", "32", "--windows", "2", "--corpus"]
    assert main([*score, paths["byte"]]) == 2
    assert f"--tokenizer {run} ...`" in capsys.readouterr().err
    corpus = tmp_path / "corpus"
    assert (
        main(
            [
                "data",
                "prepare",
                "--source",
                str(paths["root"] / "docs"),
                "--tokenizer",
                str(run),
                "--out",
                str(corpus),
                "--val-fraction",
                "0.5",
            ]
        )
        == 0
    )
    assert load_token_dataset(corpus, "val").tokenizer.to_spec() == bpe.to_spec()
    assert main([*score, str(corpus)]) == 0


def test_ppl_of_two_models_prints_paired_differences_and_writes_json(paths, capsys, tmp_path):
    import json

    argv = [
        "eval",
        "ppl",
        "--model",
        paths["drt"],
        "--model",
        paths["tf"],
        "--corpus",
        paths["byte"],
        "--lengths",
        "32,64",
    ]
    out_file = tmp_path / "r.json"
    assert main([*argv, "--windows", "2", "--window-length", "96", "--seed", "5", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "NLL minus" in out and "first L" in out and "32-L" in out and "96-token windows" in out
    record = json.loads(out_file.read_text())
    saved = record["results"][paths["tf"]]
    assert saved["window_length"] == 96 and len(saved["by_length"]["64"]["window_nll"]) == 2
    assert record["seed"] == 5  # the windows drawn: a record says how to draw them again
