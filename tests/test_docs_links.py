"""The repository's Markdown pages link only to files that exist and to headings those files have:
a section renamed or dropped, or a file moved, is caught here rather than by a reader."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# [text](target): inline links and images; code spans are removed first, so `[i](j)` in code is not a link
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def pages() -> list[Path]:
    """The Markdown pages git tracks; outside a git checkout, those of the project's own folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / name for name in listed.stdout.split()]
    except (OSError, subprocess.CalledProcessError):
        folders = ("docs", "configs", "models", "benchmarks", "experiments", "results")
        return sorted(ROOT.glob("*.md")) + sorted(p for f in folders for p in (ROOT / f).rglob("*.md"))


def prose(text: str) -> str:
    """A page without its fenced blocks and code spans, whose brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = heading.lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: and the like
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {path})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {path or page.name})")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_of_a_page_resolves(page):
    assert broken_links(page) == []


def test_the_checker_catches_a_missing_heading_and_a_missing_file(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Results\n\n## lm-eval's RULER on `byte-level` models\n\n"
        "[a](#lm-evals-ruler-on-byte-level-models) [b](#results) [c](#r7-bpe-models)\n"
        "[d](other.md#a-section-1) [e](other.md#a-section-2) [f](missing.md) `[g](#not-a-link)`\n"
        "```\n[h](#in-a-fence)\n```\n"
    )
    assert broken_links(page) == [
        "#r7-bpe-models (no heading #r7-bpe-models in page.md)",
        "other.md#a-section-2 (no heading #a-section-2 in other.md)",
        "missing.md (no file missing.md)",
    ]
