"""A prepared dataset read back is checked before it is trusted: each file that is missing,
empty, truncated or damaged is named in one line with the prepare command that writes it again,
never a traceback of json or numpy."""

import json
import shutil

import pytest

from farsight.cli import main
from farsight.data.sft import SFTSplit, prepare_sft
from farsight.data.token_files import TokenDataError, load_meta, load_token_dataset, prepare_corpus
from farsight.data.tokenizers import load_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(a corpus dataset, a dataset of supervised examples, the JSONL file of those examples)."""
    root = tmp_path_factory.mktemp("damaged")
    docs = root / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(f"document {i}: {TEXT}")
    prepare_corpus([str(docs)], load_tokenizer("byte"), root / "tokens", val_fraction=0.3, progress=False)
    records = root / "train.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"count {i}:", "completion": f" {i}"}) + "\n" for i in range(8)))
    prepare_sft([records], load_tokenizer("byte"), root / "sft", val_fraction=0.3, progress=False)
    return root / "tokens", root / "sft", records


def damaged_copy(source, tmp_path, name, damage):
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    damage(copy / name)
    return copy


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path):
    path.write_bytes(b"\xff\xfe not what was written \x00")


def make_folder(path):
    path.unlink()
    path.mkdir()


DAMAGE = {
    "emptied": lambda path: path.write_bytes(b""),
    "truncated": truncate,
    "garbled": garble,
    "a folder": make_folder,
}

# (the file, how it is damaged, what the message says of it)
CASES = [
    ("meta.json", "emptied", "is empty"),
    ("meta.json", "truncated", r"is corrupted or truncated \(not valid JSON"),
    ("meta.json", "garbled", "is not UTF-8 text"),
    ("meta.json", "a folder", "is a folder, not a file"),
    ("train.bin", "truncated", "holds .* bytes but meta.json promises"),
    ("train.bin", "a folder", "is a folder, not a file"),
    ("train.docs.npy", "emptied", "is empty"),
    ("train.docs.npy", "truncated", "is corrupted or truncated"),
    ("train.docs.npy", "garbled", r"is corrupted or truncated \(no .npy header\)"),
    ("tokenizer.json", "truncated", "is corrupted or truncated"),
    ("tokenizer.json", "garbled", "is not UTF-8 text"),
]


@pytest.mark.parametrize("name, how, problem", CASES)
def test_a_damaged_dataset_file_is_named_in_one_line(prepared, tmp_path, capsys, name, how, problem):
    tokens = damaged_copy(prepared[0], tmp_path, name, DAMAGE[how])
    with pytest.raises(
        TokenDataError, match=rf"{tokens / name} {problem}.*prepare the dataset again .*farsight data prepare "
    ):
        load_token_dataset(tokens, "train")
    assert main(["data", "info", str(tokens)]) == 2  # `data info` reads every file the meta describes
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tokens / name}") and len(err.splitlines()) == 1


def test_prepare_refuses_sources_whose_documents_are_all_empty(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.txt", "b.txt"):
        (docs / name).write_text("")
    with pytest.raises(TokenDataError, match=r"holds 2 document\(s\), all empty; check that it points"):
        prepare_corpus([str(docs)], load_tokenizer("byte"), tmp_path / "tokens", progress=False)
    assert not (tmp_path / "tokens").exists()


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda meta: meta.pop("dtype"), "lacks its 'dtype' field"),
        (lambda meta: meta.update(dtype="float64"), r"is corrupted \(dtype 'float64'"),
        (lambda meta: meta.update(vocab_size="260"), r"is corrupted \(its 'vocab_size' is '260', not an integer\)"),
        (lambda meta: meta["splits"]["train"].pop("offsets_file"), "lacks its 'offsets_file' field"),
        (lambda meta: meta["splits"]["train"].update(file="../elsewhere.bin"), "names files outside the dataset"),
        (lambda meta: meta["splits"].update(train=[]), "is not a JSON object"),
    ],
)
def test_a_meta_json_without_what_the_files_are_read_by_is_refused(prepared, tmp_path, change, problem):
    def edit(path):
        meta = json.loads(path.read_text())
        change(meta)
        path.write_text(json.dumps(meta))

    tokens = damaged_copy(prepared[0], tmp_path, "meta.json", edit)
    with pytest.raises(TokenDataError, match=rf"meta\.json.* {problem}.*prepare the dataset again"):
        load_token_dataset(tokens, "train")


@pytest.mark.parametrize(
    "how, problem",
    [("emptied", "does not hold one byte per token"), ("truncated", "does not hold one"), ("a folder", "is a folder")],
)
def test_a_damaged_loss_mask_names_prepare_sft(prepared, tmp_path, how, problem):
    sft = damaged_copy(prepared[1], tmp_path, "train.mask.bin", DAMAGE[how])
    with pytest.raises(TokenDataError, match=rf"train\.mask\.bin {problem}.*farsight data prepare-sft "):
        SFTSplit(sft, "train")


def test_a_damaged_supervised_dataset_names_prepare_sft(prepared, tmp_path):
    sft = damaged_copy(prepared[1], tmp_path, "meta.json", truncate)
    with pytest.raises(TokenDataError, match=r"meta\.json is corrupted or truncated.*farsight data prepare-sft "):
        load_meta(sft)


def test_a_missing_supervised_dataset_names_prepare_sft(tmp_path):
    with pytest.raises(TokenDataError, match=r"no prepared dataset at .*nothing.*farsight data prepare-sft "):
        SFTSplit(tmp_path / "nothing", "train")


def test_prepare_sft_refuses_the_training_file_as_the_held_out_one(prepared, tmp_path, monkeypatch, capsys):
    records = prepared[2]
    monkeypatch.chdir(records.parent)
    copy = tmp_path / "copy.jsonl"
    shutil.copy(records, copy)
    for val in (records.name, str(records), str(copy)):
        out = tmp_path / "out"
        assert main(["data", "prepare-sft", "--source", records.name, "--val", val, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "error: the held-out source" in err and len(err.splitlines()) == 1
        assert ("holds the same contents as" if val == str(copy) else "overlaps") in err
        assert not out.exists()


def test_prepare_refuses_a_held_out_copy_of_a_training_file(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT)
    with pytest.raises(TokenDataError, match=r"b\.txt holds the same contents as the training source .*a\.txt"):
        prepare_corpus([str(tmp_path / "a.txt")], "byte", tmp_path / "out", val_sources=[str(tmp_path / "b.txt")])
