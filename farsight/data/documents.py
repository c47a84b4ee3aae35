"""Documents and the `Source` base class every corpus source derives from, with the error they raise."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from farsight.errors import FarsightError

UNSPECIFIED_LICENSE = "unspecified (check the data's own terms)"


class CorpusError(FarsightError, ValueError):
    """A source cannot be found, read or parsed; the message names the problem and the fix."""


@dataclass(frozen=True)
class Document:
    """One document: a stable id, its text, the license it is distributed under and an optional title."""

    doc_id: str
    text: str
    license: str = UNSPECIFIED_LICENSE
    title: str | None = None


class Source(ABC):
    """An iterable of documents with a spec string and a license that describe where they came from."""

    kind: ClassVar[str]

    def __init__(self, spec: str, license: str) -> None:
        self.spec = spec
        self.license = license

    @abstractmethod
    def __iter__(self) -> Iterator[Document]:
        """Documents in a deterministic order."""

    def describe(self) -> dict[str, Any]:
        """Provenance recorded in a prepared dataset's meta.json."""
        return {"spec": self.spec, "kind": self.kind, "license": self.license}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
