# Every target installs what it needs into .venv first (torch pinned by constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS := --disable-pip-version-check -q
CORPUS := data/stdlib-byte

.PHONY: install lint format test test-slow test-all demo demo-train bench clean r1 r2 r3 r4 r5 r6 r7 summarize ruler code-corpus results

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The default suite (every op and model checked for exactness; well within 8 minutes on two cores),
# with its 20 slowest tests listed; test-slow runs the large shapes and long runs left out of it,
# test-all both.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or not slow" --durations=20

# Passkey retrieval from the training length (1K) up to 1M tokens with the shipped checkpoint.
demo: $(STAMP)
	$(BIN)/farsight demo --model models/demo-drt --corpus $(CORPUS)

$(CORPUS)/meta.json: | $(STAMP)
	$(BIN)/farsight data prepare --source stdlib --tokenizer byte --out $(CORPUS)

# Retrain the shipped checkpoint from scratch with the committed configs, and time it: drt-x2
# pre-trained as a language model (52M tokens at 4K, configs/lm/pretrain/drt-x2.yaml) then
# fine-tuned on passkeys with the needle sentences out of the loss (configs/lm/passkey/drt-x2-nw0.yaml;
# the language-model protocol of docs/results.md, R1).
demo-train: $(STAMP)
	@start=$$(date +%s); \
	bash experiments/lm-data.sh && \
	$(BIN)/farsight train configs/lm/pretrain/drt-x2.yaml --restart --set train.out_dir=runs/demo-drt-lm && \
	$(BIN)/farsight train configs/lm/passkey/drt-x2-nw0.yaml --restart --set train.init_from=runs/demo-drt-lm --set train.out_dir=runs/demo-drt && \
	$(BIN)/farsight export runs/demo-drt models/demo-drt --dtype bf16 --card && \
	echo "demo-train: retrained models/demo-drt in $$(( $$(date +%s) - start )) s"

# The reproductions of docs/results.md (R1-R6): each trains what it needs, evaluates, and writes
# results/rN/ and docs/figures/. Hours on a 2-core CPU; r2 builds on r1's runs, r4 on r3's.
# configs/README.md lists the configs each one trains.
r1 r2 r3 r4 r5 r6: $(STAMP) $(CORPUS)/meta.json
	bash experiments/$@.sh

# The summarization stand-in (experiments/summarize.sh): Python modules of 2K-64K byte tokens in,
# their docstring's summary line out; fine-tunes the pre-trained drt-x1, drt-x2, baselm and baselm-2l
# (configs/lm/summarize/) and scores their greedy answers with ROUGE by input length.
summarize: $(STAMP)
	bash experiments/summarize.sh

# lm-eval's own RULER tasks at 4K-128K tokens on byte-level models fine-tuned on this CPU
# (experiments/ruler.sh): drt-x2, drt-x1 and baselm-2l from the shipped base models, a passkey stage,
# the RULER mix, then the mix with single needles weighted up (configs/lm/ruler/stage1-<model>.yaml,
# configs/lm/ruler/composed/, configs/lm/ruler/refresh/), exported to models/ruler-*, which every
# measurement reads; then drt-x2's multi-key stages with needles one to a line
# (experiments/ruler-lines.sh, configs/lm/ruler/lines/), exported to models/ruler-drt-x2-lines;
# finished runs, exports and result files are reused.
ruler: $(STAMP)
	bash experiments/ruler.sh
	bash experiments/ruler-lines.sh

# A BPE corpus of long real documents held out by package, page and book (experiments/code-corpus.sh):
# Python source, the Python documentation and Gutenberg books, a 16K-entry BPE, token files.
code-corpus: $(STAMP)
	bash experiments/code-corpus.sh

# R7 (experiments/r7.sh): drt-x2, baselm-2l and drt-x1 of about 13M parameters pre-trained on 50M BPE
# tokens of that corpus (configs/bpe/pretrain/), fine-tuned on a retrieval mix in many wordings
# (configs/bpe/finetune/), scored with lm-eval's RULER tasks, the passkey to 1M and perplexity.
# Hours per model on a 2-core CPU.
r7: $(STAMP)
	bash experiments/r7.sh

# The tables of docs/results.md and README.md, rewritten from the records in results/ (between their
# `<!-- table: ... -->` markers; the prose is left alone). `--check` rewrites nothing and names each
# table that differs from its records, as tests/test_results_tables.py does.
results: $(STAMP)
	$(BIN)/python experiments/results_tables.py

bench: $(STAMP)
	$(BIN)/farsight eval bench

clean:
	rm -rf $(VENV) *.egg-info
