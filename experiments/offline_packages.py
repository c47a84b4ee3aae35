"""Offline Python sources for the experiments' datasets: the standard library, this Python's
site-packages or a folder of packages, read module by module with each module's package, so a
dataset can hold packages out whole (experiments/summarize-data.py, experiments/code-corpus.py)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from farsight.data.corpora import StdlibSource

# folders that hold copies of other packages (pip's requests, setuptools' packaging, ...): left
# out, so a held-out package cannot also be trained on as someone's vendored copy
VENDORED = {"_vendor", "vendor", "_vendored", "vendored", "_vendored_packages", "extern", "_extern"}


def source_roots(specs: list[str]) -> list[tuple[str, Path]]:
    """(label, folder) of each --source: stdlib, site-packages (this Python's purelib) or a folder of packages."""
    roots = []
    for spec in specs:
        if spec == "stdlib":
            roots.append(("stdlib", Path(sysconfig.get_paths()["stdlib"])))
        elif spec == "site-packages":
            roots.append(("site-packages", Path(sysconfig.get_paths()["purelib"])))
        else:
            path = Path(spec)
            if not path.is_dir():
                sys.exit(f"error: --source {spec} is not stdlib, site-packages or a folder")
            roots.append((path.name, path))
    labels = [label for label, _ in roots]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        sys.exit(f"error: two --source folders are named {repeated[0]}; their modules would share ids, so rename one")
    return roots


def modules(root: Path) -> list[Path]:
    """The .py files under root, tests skipped (as `farsight data prepare --source stdlib` does) and vendored folders too."""
    return [path for path in StdlibSource(root).files() if not VENDORED & set(path.relative_to(root).parent.parts)]


def package_of(label: str, relative: Path) -> str:
    """The unit a module is held out with: LABEL/its top-level package (or LABEL/module for a
    top-level module), for a module at `relative` under a source root."""
    return f"{label}/{relative.parts[0] if len(relative.parts) > 1 else relative.stem}"


def package_versions(names: set[str]) -> dict[str, str]:
    """The installed distribution (name==version) of each top-level package name, where one is known."""
    found = importlib.metadata.packages_distributions()
    versions = {}
    for name in sorted(names):
        dists = sorted(set(found.get(name, [])))
        if dists:
            versions[name] = ", ".join(f"{d}=={importlib.metadata.version(d)}" for d in dists)
    return versions


def write_text_atomic(path: Path, text: str) -> None:
    """Write text atomically (a temporary file beside `path`, renamed over it)."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private; the dataset is an ordinary file
    os.replace(tmp, path)
