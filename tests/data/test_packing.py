"""Packed batches (data.pack): `document_ids` on token windows and supervised examples packed
end to end into rows; with pack off the batches are exactly those of before."""

import json

import numpy as np
import pytest
import torch

from farsight.config import ConfigError
from farsight.data.batch_source import batch_rng
from farsight.data.batches import build_batch_source, describe_data
from farsight.data.sft import SFTSplit, prepare_sft
from farsight.data.sft_batches import first_fit, length_bucket, pad_examples
from farsight.data.token_batches import window_document_ids
from farsight.data.token_files import load_token_dataset, prepare_corpus
from farsight.data.tokenizers import load_tokenizer
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM
from farsight.ops.documents import check_document_ids
from tests.data.sft_records import pairs, write_jsonl

TOK = load_tokenizer("byte")
# the training documents' texts, in bytes (each is followed by its eos): short and long, one of a single byte
LENGTHS = [5, 1, 12, 3, 40, 7, 20, 2, 9, 30, 4, 16]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """A corpus whose training documents have the known LENGTHS (plus their eos), in file order."""
    root = tmp_path_factory.mktemp("packed-tokens")
    train, val = root / "train", root / "val"
    train.mkdir()
    val.mkdir()
    for i, n in enumerate(LENGTHS):
        (train / f"d{i:02d}.txt").write_text("abcdefghij"[i % 10] * n)
    for i, n in enumerate([6, 25, 3, 11]):
        (val / f"v{i}.txt").write_text("z" * n)
    prepare_corpus([str(train)], TOK, root / "tokens", val_sources=[str(val)], progress=False)
    return root / "tokens"


def offsets():
    return np.cumsum([0] + [n + 1 for n in LENGTHS[:-1]])


def token_data(path, **changes):
    return {"kind": "tokens", "path": str(path), "seq_len": 24, "batch_size": 6, **changes}


def test_the_fixture_documents_start_where_expected(token_dir):
    assert load_token_dataset(token_dir, "train").documents()[:, 0].tolist() == offsets().tolist()


def test_window_document_ids_count_the_documents_begun_inside_each_window(token_dir):
    starts_of_documents = offsets()
    total = sum(LENGTHS) + len(LENGTHS)
    n = 24
    starts = np.arange(total - n)
    ids = window_document_ids(starts_of_documents, starts, n)
    assert ids.dtype == torch.int64 and ids.shape == (len(starts), n)
    for s in starts:
        expected = [sum(1 for o in starts_of_documents if s < o <= s + j) for j in range(n)]
        assert ids[s].tolist() == expected, s
    # a window that starts on a document's first token, one that ends on a document's eos
    first = int(starts_of_documents[4])
    assert window_document_ids(starts_of_documents, np.asarray([first]), 3).tolist() == [[0, 0, 0]]
    assert window_document_ids(starts_of_documents, np.asarray([first - 1]), 3).tolist() == [[0, 1, 1]]


def test_packed_token_windows_carry_document_ids_that_restart_after_each_eos(token_dir):
    packed = build_batch_source(token_data(token_dir, pack=True), seed=3)
    plain = build_batch_source(token_data(token_dir), seed=3)
    for batch, other in (
        *((packed.train_batch(step, 0, 0), plain.train_batch(step, 0, 0)) for step in range(8)),
        (packed.eval_batch(1), plain.eval_batch(1)),
    ):
        ids, documents = batch["input_ids"], batch["document_ids"]
        assert set(batch) == {"input_ids", "labels", "document_ids"} and documents.shape == ids.shape
        check_document_ids(documents, tuple(ids.shape))  # integers, never decreasing along a row
        assert (documents[:, 0] == 0).all()
        # a new document begins exactly after each eos (each document ends with one)
        assert torch.equal(documents[:, 1:] - documents[:, :-1], (ids[:, :-1] == TOK.eos_id).long())
        # the same windows as without packing
        assert torch.equal(ids, other["input_ids"]) and torch.equal(batch["labels"], other["labels"])
    assert (torch.cat([packed.train_batch(s, 0, 0)["document_ids"] for s in range(8)]) > 0).any()
    assert describe_data(token_data(token_dir, pack=True)).endswith(
        "per step, each token attending within its own document (packed)"
    )
    assert describe_data(token_data(token_dir)).endswith("6 windows of 24 tokens per step")


def test_unpacked_token_windows_are_the_windows_of_before(token_dir):
    source = build_batch_source(token_data(token_dir), seed=5)
    train = load_token_dataset(token_dir, "train")
    for step, micro, rank in ((0, 0, 0), (4, 1, 0), (7, 0, 1)):
        batch = source.train_batch(step, micro, rank)
        starts = batch_rng(5, 0, step, micro, rank).integers(0, len(train) - 24, size=6)
        expected = torch.from_numpy(np.stack([np.asarray(train.tokens[s : s + 24], dtype=np.int64) for s in starts]))
        assert set(batch) == {"input_ids", "labels"}
        assert torch.equal(batch["input_ids"], expected) and batch["labels"] is batch["input_ids"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kind": "tokens", "path": "d", "pack": "yes"}, "data.pack must be true or false, got 'yes'"),
        ({"kind": "sft", "path": "d", "pack": 1}, "data.pack must be true or false, got 1"),
        ({"kind": "needle", "pack": True}, "unknown config field 'data.pack' for NeedleBatchConfig"),
    ],
)
def test_a_pack_that_is_not_true_or_false_is_refused_in_one_line(data, message):
    with pytest.raises(ConfigError, match=message) as raised:
        build_batch_source(data, seed=0)
    assert "\n" not in str(raised.value)


# ---- supervised examples ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-sft")
    for name, n, seed in (("train", 40, 0), ("val", 8, 1)):
        write_jsonl(root / f"{name}.jsonl", pairs(n, seed))
    prepare_sft([root / "train.jsonl"], TOK, root / "data", val_sources=[root / "val.jsonl"], progress=False)
    return root / "data"


def sft_data(path, **changes):
    return {"kind": "sft", "path": str(path), "seq_len": 160, "batch_tokens": 640, **changes}


def documents_of(batch, row):
    """The (ids, weights) of each document of a packed row, and the padding's (start, document id)."""
    ids, weights, documents = batch["input_ids"][row], batch["loss_weights"][row], batch["document_ids"][row]
    labels = batch["labels"][row]
    real = int((labels != -100).sum())
    pieces = []
    for d in documents[:real].unique_consecutive().tolist():
        where = (documents == d).nonzero()[:, 0]
        pieces.append((ids[where].tolist(), weights[where].tolist()))
    return pieces, real


def test_packed_rows_hold_whole_examples_end_to_end(sft_dir):
    source = build_batch_source(sft_data(sft_dir, pack=True), seed=0)
    split = SFTSplit(sft_dir, "train")
    examples = {tuple(split.example(i)[0].tolist()): split.example(i)[1].tolist() for i in range(len(split))}
    used = 0
    for step in range(12):
        batch = source.train_batch(step, 0, 0)
        ids, labels, weights, documents = (batch[k] for k in ("input_ids", "labels", "loss_weights", "document_ids"))
        assert set(batch) == {"input_ids", "labels", "loss_weights", "document_ids"}
        assert ids.shape[0] == 640 // 160 and ids.shape[1] <= 160  # batch_tokens // seq_len rows of at most seq_len
        check_document_ids(documents, tuple(ids.shape))
        assert (documents[:, 0] == 0).all() and ((documents[:, 1:] - documents[:, :-1]) <= 1).all()
        real = labels != -100
        assert int(real.sum(1).max()) == ids.shape[1]  # padded to the longest row only
        for row in range(ids.shape[0]):
            pieces, n = documents_of(batch, row)
            assert n > 0 and real[row, :n].all() and not real[row, n:].any()  # real tokens first, then padding
            for tokens, loss in pieces:  # each document is a whole example, its loss on its completion only
                assert tuple(tokens) in examples and [int(w) for w in loss] == examples[tuple(tokens)]
            used += len(pieces)
            assert labels[row, :n].tolist() == ids[row, :n].tolist()
            # the padding: pad_id, no label, no loss, a document of its own after the row's last
            assert (ids[row, n:] == TOK.pad_id).all() and (weights[row, n:] == 0).all()
            assert (documents[row, n:] == len(pieces)).all()
            assert int(documents[row, n - 1]) == len(pieces) - 1
    assert used > 12 * 4  # several examples a row
    val = source.eval_batch(0)
    assert torch.equal(val["answer_mask"], val["loss_weights"] > 0) and "document_ids" in val
    assert "packed end to end into 4 rows of up to 160 tokens per step" in describe_data(sft_data(sft_dir, pack=True))
    assert "batched by length" in describe_data(sft_data(sft_dir))


def test_packed_batches_are_a_function_of_seed_step_micro_and_rank(sft_dir):
    source = build_batch_source(sft_data(sft_dir, pack=True), seed=0)
    again = build_batch_source(sft_data(sft_dir, pack=True), seed=0)
    reference = source.train_batch(3, 1, 1)
    for key, value in again.train_batch(3, 1, 1).items():
        assert torch.equal(value, reference[key]), key
    for other in (source.train_batch(4, 1, 1), source.train_batch(3, 0, 1), source.train_batch(3, 1, 0)):
        assert not torch.equal(other["input_ids"][:, :8], reference["input_ids"][:, :8])
    other_seed = build_batch_source(sft_data(sft_dir, pack=True), seed=1).train_batch(3, 1, 1)
    assert not torch.equal(other_seed["input_ids"][:, :8], reference["input_ids"][:, :8])
    assert torch.equal(source.eval_batch(2)["input_ids"], again.eval_batch(2)["input_ids"])


class ScriptedDraws:
    """A stand-in for the random generator: `integers` gives the scripted example indices in turn."""

    def __init__(self, draws):
        self.draws = iter(draws)

    def integers(self, high):
        return next(self.draws)


@pytest.mark.parametrize(
    "draws, rows",
    [
        ([0, 1, 2, 3, 4, 0], [[0, 1], [2, 3]]),  # 5+3 fill row 0; 4+2 go to row 1; 6 fits neither: the batch ends
        ([4, 2, 3, 1, 0], [[4, 3], [2, 1]]),  # 2 goes back to row 0 (the first with room), 3 to row 1; 5 fits neither
        ([5, 5, 5, 5, 5], [[5], [5]]),  # 8 fills a row; the third fits neither
    ],
)
def test_first_fit_puts_each_example_in_the_first_row_with_room(draws, rows):
    lengths = np.asarray([5, 3, 4, 2, 6, 8])
    assert first_fit(ScriptedDraws(draws), np.arange(6), lengths, rows=2, seq_len=8) == rows


def test_first_fit_never_splits_an_example_and_never_leaves_a_row_empty():
    lengths = np.asarray([7, 50, 100, 3, 64, 99, 1, 30])
    for seed in range(50):
        rows = first_fit(np.random.default_rng(seed), np.arange(8), lengths, rows=3, seq_len=100)
        assert len(rows) == 3 and all(rows) and all(lengths[row].sum() <= 100 for row in rows)


def test_pack_keeps_too_long_examples_out_or_refuses_them(sft_dir):
    longest = json.loads((sft_dir / "meta.json").read_text())["splits"]["train"]["longest"]
    with pytest.raises(ConfigError, match=f"longer than data.seq_len=100 \\(the longest holds {longest} tokens\\)"):
        build_batch_source(sft_data(sft_dir, seq_len=100, pack=True), seed=0)
    source = build_batch_source(sft_data(sft_dir, seq_len=100, batch_tokens=250, pack=True, too_long="skip"), seed=0)
    for step in range(5):
        batch = source.train_batch(step, 0, 0)
        assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] <= 100
    with pytest.raises(ConfigError, match="batch_tokens"):
        build_batch_source(sft_data(sft_dir, batch_tokens=100, pack=True), seed=0)


def test_unpacked_supervised_batches_are_the_batches_of_before(sft_dir):
    """pack: false takes today's length buckets: the same random draws, the same padded batch."""
    source = build_batch_source(sft_data(sft_dir, batch_tokens=320), seed=7)
    split = SFTSplit(sft_dir, "train")
    keys = np.asarray([length_bucket(int(n)) for n in split.lengths])
    buckets = [np.flatnonzero(keys == key) for key in np.unique(keys)]
    p = np.asarray([len(b) for b in buckets], dtype=np.float64)
    p /= p.sum()
    for step, micro, rank in ((0, 0, 0), (5, 1, 0), (9, 0, 1)):
        rng = batch_rng(7, 0, step, micro, rank)
        members = buckets[int(rng.choice(len(buckets), p=p))]
        rows = max(1, 320 // int(split.lengths[members].max()))
        picked = rng.choice(members, size=rows, replace=len(members) < rows)
        expected = pad_examples([split.example(int(i)) for i in picked], TOK.pad_id)
        batch = source.train_batch(step, micro, rank)
        assert set(batch) == {"input_ids", "labels", "loss_weights"}
        for key, value in expected.items():
            assert torch.equal(batch[key], value), key


def tiny_models():
    torch.manual_seed(0)
    small = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
    return {
        "causal": TransformerForCausalLM(TransformerConfig(**small)),
        "sliding": TransformerForCausalLM(TransformerConfig(**small, attention="sliding", window=16)),
        "castle": TransformerForCausalLM(TransformerConfig(**small, attention="castle")),
        "drt": DRTForCausalLM(DRTConfig(**small, chunk_size=8, window=16, top_k=2, encoder_layers=1)),
    }


@pytest.mark.parametrize("kind", ["causal", "sliding", "castle", "drt"])
def test_a_packed_batch_has_the_loss_of_its_examples_one_at_a_time(sft_dir, kind):
    """Each model keeps a packed example to itself: the packed batch's loss is the weighted mean of
    the examples' own losses, each run alone without padding."""
    model = tiny_models()[kind].eval()  # eval: no Gumbel noise in DRT's retrieval
    batch = build_batch_source(sft_data(sft_dir, pack=True), seed=0).train_batch(0, 0, 0)
    examples = []
    for row in range(batch["input_ids"].shape[0]):
        pieces, _ = documents_of(batch, row)
        examples += [(np.asarray(ids), np.asarray(weights, dtype=np.uint8)) for ids, weights in pieces]
    assert len(examples) > batch["input_ids"].shape[0]
    with torch.no_grad():
        packed = model(**batch).loss
        total = weight = 0.0
        for ids, mask in examples:
            n = float(mask[1:].sum())
            total += float(model(**pad_examples([(ids, mask)], TOK.pad_id)).loss) * n
            weight += n
    torch.testing.assert_close(packed, torch.tensor(total / weight), rtol=1e-5, atol=1e-5)
