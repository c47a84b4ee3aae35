#!/usr/bin/env python3
"""A long-input -> short-output task built offline from Python source: the stand-in for the DRT
paper's summarization fine-tune (a long article in, a short summary out, scored with ROUGE).

Each example is one Python module of 2K to 64K bytes (byte tokens) whose docstring opens with a
one-line summary (PEP 257): the input is the module's source with that summary line cut out of
its docstring, followed by a question line; the answer is the summary line.

    prompt:      <the module's source, its docstring's first line removed>
                 \\n# The summary line of this module's docstring:\\n
    completion:  Utilities for comparing files and directories.

Deterministic (a given set of installed files always gives the same files, byte for byte) and
offline. Held out by package: every module of a top-level package goes to the same split (by a
hash of the package's name), so no test module shares a package with a training module.
Left out: modules without such a summary, a summary that also appears elsewhere in the module
(it would give the answer away) or as the summary of a module in another package (copies of
vendored modules), vendored folders, tests, and inputs outside the length range.

    python experiments/summarize-data.py --source site-packages --out data/summarize
    python experiments/summarize-data.py --source stdlib --source path/to/packages --out data/summarize-mine

Writes OUT/train.jsonl, OUT/val.jsonl, OUT/test.jsonl ({"prompt", "completion", "id", "package"})
and OUT/manifest.json (sources, package versions, settings and counts), and prints the counts.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from offline_packages import modules, package_of, package_versions, source_roots, write_text_atomic

from farsight.data.corpora import decode_text
from farsight.data.token_files import split_score

QUESTION = "\n\n# The summary line of this module's docstring:\n"
BUCKETS = [(1 << k, 1 << (k + 1)) for k in range(11, 16)]  # 2K-4K ... 32K-64K
SPLITS = ("train", "val", "test")


def summary_of(source: str) -> tuple[str, str] | str:
    """(the summary line, the source with it cut out of the docstring), or why the module has none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old modules
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "not parseable"
    first = tree.body[0] if tree.body else None
    if not (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ):
        return "no docstring"
    lines = first.value.value.strip().split("\n")
    summary = lines[0].strip()
    if len(lines) > 1 and lines[1].strip():
        return "summary not one line"
    if not 10 <= len(summary) <= 200 or len(summary.split()) < 2:
        return "summary too short or long"
    text = source.splitlines(keepends=True)
    for number in range(first.lineno - 1, first.end_lineno or first.lineno):
        if summary in text[number]:
            text[number] = text[number].replace(summary, "", 1)
            break
    else:
        return "summary not verbatim in the source"
    cut = "".join(text)
    if summary in cut:
        return "summary elsewhere in the module"
    return summary, cut


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        action="append",
        help="stdlib, site-packages or a folder of packages (repeatable; default: site-packages)",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--min-tokens", type=int, default=2048, help="shortest example in byte tokens (default 2K)")
    parser.add_argument("--max-tokens", type=int, default=65536, help="longest example in byte tokens (default 64K)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of packages held out for validation")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="share of packages held out for the test")
    parser.add_argument(
        "--max-per-package", type=int, default=100, help="the most modules kept of one package (0: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the package split and of the per-package cap")
    args = parser.parse_args()
    if not (0 < args.val_fraction and 0 < args.test_fraction and args.val_fraction + args.test_fraction < 1):
        sys.exit("error: --val-fraction and --test-fraction must be above 0 and add up to less than 1")
    skipped: Counter = Counter()
    candidates = []  # (package, id, prompt, completion)
    roots = source_roots(args.source or ["site-packages"])
    for label, root in roots:
        for path in modules(root):
            relative = path.relative_to(root)
            package = package_of(label, relative)
            found = summary_of(decode_text(path.read_bytes())[0])
            if isinstance(found, str):
                skipped[found] += 1
                continue
            summary, cut = found
            prompt = cut.rstrip("\n") + QUESTION
            tokens = len(prompt.encode()) + len(summary.encode()) + 1  # byte tokens, with the eos
            if not args.min_tokens <= tokens <= args.max_tokens:
                skipped["outside the length range"] += 1
                continue
            candidates.append((package, f"{label}/{relative.as_posix()}", prompt, summary))
    packages_of = defaultdict(set)
    for package, _, _, summary in candidates:
        packages_of[summary].add(package)
    shared = {summary for summary, packages in packages_of.items() if len(packages) > 1}
    skipped["summary shared with another package"] += sum(summary in shared for *_, summary in candidates)
    by_package = defaultdict(list)
    for item in candidates:
        if item[3] not in shared:
            by_package[item[0]].append(item)
    splits: dict[str, list] = {split: [] for split in SPLITS}
    packages: dict[str, list[str]] = {split: [] for split in SPLITS}
    for package in sorted(by_package):
        items = sorted(by_package[package], key=lambda item: split_score(item[1], args.seed))
        if args.max_per_package and len(items) > args.max_per_package:
            skipped["over --max-per-package"] += len(items) - args.max_per_package
            items = items[: args.max_per_package]
        score = split_score(package, args.seed)
        split = (
            "val"
            if score < args.val_fraction
            else "test"
            if score < args.val_fraction + args.test_fraction
            else "train"
        )
        splits[split] += sorted(items, key=lambda item: item[1])
        packages[split].append(package)
    empty = [split for split in SPLITS if not splits[split]]
    if empty:
        sys.exit(
            f"error: no package went to {', '.join(empty)} ({len(by_package)} packages in all); "
            "add sources, or raise --val-fraction/--test-fraction"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        lines = [
            json.dumps({"prompt": prompt, "completion": summary, "id": ident, "package": package}) + "\n"
            for package, ident, prompt, summary in splits[split]
        ]
        write_text_atomic(out / f"{split}.jsonl", "".join(lines))
        lengths = [len(p.encode()) + len(s.encode()) + 1 for _, _, p, s in splits[split]]
        counts[split] = {
            "packages": len(packages[split]),
            "examples": len(lengths),
            "tokens": sum(lengths),
            "by_length": {  # [lo, hi); an example of exactly 64K counts as 32K-64K
                f"{lo // 1024}K-{hi // 1024}K": sum(lo <= n < hi or n == hi == BUCKETS[-1][1] for n in lengths)
                for lo, hi in BUCKETS
            },
        }
    names = {package.split("/", 1)[1] for split in SPLITS for package in packages[split]}
    manifest = {
        "python": sys.version.split()[0],
        "sources": {label: str(root) for label, root in roots},
        "package_versions": package_versions(names) if any(label == "site-packages" for label, _ in roots) else {},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "question": QUESTION,
        "packages": packages,
        "counts": counts,
        "skipped": dict(sorted(skipped.items())),
    }
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    columns = ["split", "packages", "examples", "MB", *counts["train"]["by_length"]]
    print("  ".join(f"{c:>9}" for c in columns))
    for split in SPLITS:
        c = counts[split]
        cells = [split, c["packages"], c["examples"], f"{c['tokens'] / 1e6:.1f}", *c["by_length"].values()]
        print("  ".join(f"{cell:>9}" for cell in cells))
    print("left out: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])))
    print(f"wrote {out}/train.jsonl, val.jsonl, test.jsonl and manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
