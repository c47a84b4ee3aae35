"""Supervised examples (farsight.data.sft, data.kind: sft): the records, the chat template, the
loss mask, bad records with their FILE:LINE, the skip counts, and length batching."""

import json

import numpy as np
import pytest
import torch

from farsight.cli import main
from farsight.config import ConfigError
from farsight.data.batches import build_batch_source
from farsight.data.sft import (
    SFTDataError,
    SFTSplit,
    encode_segments,
    parse_record,
    prepare_sft,
    prompt_ids,
    read_examples,
)
from farsight.data.sft_batches import pad_examples
from farsight.data.token_files import TokenDataError, prepare_corpus
from farsight.data.tokenizers import load_tokenizer, train_bpe_tokenizer
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM
from tests.data.sft_records import pairs, write_jsonl

TOK = load_tokenizer("byte")


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    train = write_jsonl(root / "train.jsonl", pairs(40))
    val = write_jsonl(root / "val.jsonl", pairs(6, seed=1))
    prepare_sft([train], TOK, root / "data", val_sources=[val], progress=False)
    return root / "data"


def test_prompt_completion_tokens_and_loss_mask():
    example = parse_record({"prompt": "Q: 2+2?", "completion": " 4", "id": 7}, "f.jsonl:1")
    ids, mask = encode_segments(TOK, example.segments)
    assert TOK.decode(ids.tolist()) == "Q: 2+2? 4" + TOK.decode([TOK.eos_id])
    assert mask.tolist() == [0] * 7 + [1, 1, 1]  # " 4" and the eos
    assert prompt_ids(TOK, example).tolist() == TOK.encode("Q: 2+2?")
    assert example.reference == " 4"


def test_chat_template_renders_headers_and_learns_every_assistant_turn():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ]
    example = parse_record({"messages": messages}, "chat.jsonl:3")
    eos = "\x00"

    def text(ids):
        return "".join(eos if i == TOK.eos_id else chr(i) for i in ids)

    ids, mask = encode_segments(TOK, example.segments)
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\x00<|user|>\nBye\n<|assistant|>\nBye!\x00"
    assert text(ids) == rendered
    learnt = "".join(c for c, m in zip(text(ids), mask) if m)
    assert learnt == "Hello.\x00Bye!\x00"  # assistant contents and their eos only
    # generation is fed everything before the last answer: the template through its header
    assert text(prompt_ids(TOK, example)) == rendered[: rendered.rindex("Bye!")]
    assert example.reference == "Bye!"


def test_segments_are_tokenized_apart_so_the_boundary_is_exact():
    bpe = train_bpe_tokenizer(["hello world, hello there. " * 50], vocab_size=300)
    example = parse_record({"prompt": "hello wor", "completion": "ld"}, "f:1")
    ids, mask = encode_segments(bpe, example.segments)
    prompt = bpe.encode("hello wor")
    assert ids[: len(prompt)].tolist() == prompt and mask[: len(prompt)].sum() == 0
    assert ids[len(prompt) :].tolist() == [*bpe.encode("ld"), bpe.eos_id] and mask[len(prompt) :].all()


BAD = [
    ("not json", "invalid JSON"),
    ("[1, 2]", "a JSON array where a JSON object belongs"),
    ({"text": "x"}, 'neither "prompt" and "completion" nor "messages" (its keys: text)'),
    ({"prompt": "x"}, 'has "prompt" but no "completion"'),
    ({"prompt": "x", "completion": 3}, '"completion" must be a string, got int'),
    ({"prompt": "x", "completion": ""}, "empty completion"),
    ({"prompt": "", "completion": "y"}, "empty prompt"),
    ({"messages": []}, '"messages" must be a non-empty list'),
    ({"messages": [{"role": "user", "content": "hi"}]}, "the last message is the user's"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "message 0 has role 'bot'"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
        "message 1 (assistant) is empty",
    ),
    ({"messages": [{"role": "assistant", "content": "a"}], "prompt": "p"}, "keep one of the two forms"),
]


@pytest.mark.parametrize("record,reason", BAD, ids=[reason for _, reason in BAD])
def test_a_bad_record_is_refused_with_its_file_and_line(tmp_path, capsys, record, reason):
    path = write_jsonl(tmp_path / "train.jsonl", [*pairs(2), record, *pairs(2, seed=3)])
    with pytest.raises(SFTDataError, match="skip-bad-records") as error:
        list(read_examples(path))
    assert str(error.value).startswith(f"{path}:3: ") and reason in str(error.value)
    code = main(["data", "prepare-sft", "--source", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: {path}:3: ") and reason in err[-1]
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_an_example_longer_than_max_len_is_refused_or_skipped(tmp_path, capsys):
    records = [*pairs(4), {"prompt": "x" * 300, "completion": " y"}, *pairs(4, seed=2)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    argv = ["data", "prepare-sft", "--source", str(path), "--max-len", "200", "--val-fraction", "0.3"]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {path}:5: the example holds 303 tokens") and "--max-len 200" in err
    assert main([*argv, "--out", str(tmp_path / "kept"), "--skip-bad-records"]) == 0
    assert f"skipped 1 bad record: 1 too long (first at {path}:5)" in capsys.readouterr().err
    meta = json.loads((tmp_path / "kept" / "meta.json").read_text())
    assert meta["sft"]["skipped"] == {"too long": 1} and meta["sft"]["max_len"] == 200
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == 8


def test_skip_bad_records_counts_each_kind(tmp_path, capsys):
    records = [*pairs(5), "{oops", {"prompt": "a", "completion": ""}, {"prompt": "b", "completion": ""}, *pairs(3, 4)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    code = main(
        ["data", "prepare-sft", "--source", str(path), "--out", str(tmp_path / "d"), "--skip-bad-records"]
        + ["--val-fraction", "0.3"]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert (
        f"skipped 3 bad records: 2 empty completion (first at {path}:7), 1 invalid JSON (first at {path}:6)"
        in captured.err
    )
    assert "wrote " in captured.out
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["sft"]["skipped"] == {"empty completion": 2, "invalid JSON": 1}
    assert meta["sources"][0]["skipped"] == 3 and meta["sources"][0]["examples"] == 8


def test_prepared_files_hold_each_example_and_its_mask(sft_dir, tmp_path):
    train = SFTSplit(sft_dir, "train")
    records = [parse_record(r, "") for r in pairs(40)]
    assert len(train) == 40
    for i in (0, 17, 39):
        ids, mask = train.example(i)
        expected_ids, expected_mask = encode_segments(TOK, records[i].segments)
        assert ids.tolist() == expected_ids.tolist() and mask.tolist() == expected_mask.tolist()
    meta = json.loads((sft_dir / "meta.json").read_text())
    assert set(meta["checksums"]) >= {"train.mask.bin", "val.mask.bin"}
    assert meta["splits"]["val"]["documents"] == 6 and meta["val_fraction"] is None
    # replacing a dataset in place, and a language-model corpus in its folder, keep the files consistent
    again = tmp_path / "again"
    prepare_sft([sft_dir.parent / "train.jsonl"], TOK, again, progress=False)
    prepare_sft([sft_dir.parent / "val.jsonl"], TOK, again, val_fraction=0.5, progress=False)
    assert len(SFTSplit(again, "train")) + len(SFTSplit(again, "val")) == 6
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"text {i} " * 20)
    prepare_corpus([str(docs)], TOK, again, progress=False)
    assert not (again / "train.mask.bin").exists()
    with pytest.raises(TokenDataError, match="not supervised examples; prepare them with `farsight data prepare-sft"):
        SFTSplit(again, "train")


def sft_data(path, **changes):
    return {"kind": "sft", "path": str(path), "seq_len": 160, "batch_tokens": 320, **changes}


def test_batches_are_length_buckets_padded_out_of_the_loss(sft_dir):
    source = build_batch_source(sft_data(sft_dir), seed=0)
    train = SFTSplit(sft_dir, "train")
    for step in range(6):
        batch = source.train_batch(step, 0, 0)
        ids, labels, weights = batch["input_ids"], batch["labels"], batch["loss_weights"]
        real = labels != -100
        lengths = real.sum(1)
        assert ids.shape[0] == max(1, 320 // int(lengths.max())) or ids.shape[0] * int(lengths.max()) <= 320
        assert (lengths.float().max() / lengths.float().min()) < 2 ** (1 / 4) * 1.01  # one quarter-octave bucket
        assert ((ids == TOK.pad_id) == ~real).all() and (weights[~real] == 0).all()  # padding: no loss
        assert int(lengths.max()) == ids.shape[1]  # padded to the longest row only
        for row in range(ids.shape[0]):  # every row is one example, from its first token
            n = int(lengths[row])
            match = [i for i in range(len(train)) if train.example(i)[0].tolist() == ids[row, :n].tolist()]
            assert match and train.example(match[0])[1].tolist() == weights[row, :n].int().tolist()
    assert torch.equal(source.train_batch(3, 0, 1)["input_ids"], source.train_batch(3, 0, 1)["input_ids"])
    val = source.eval_batch(0)
    assert torch.equal(val["answer_mask"], val["loss_weights"] > 0)


def test_examples_longer_than_seq_len_are_refused_or_left_out(sft_dir, farsight_log):
    longest = json.loads((sft_dir / "meta.json").read_text())["splits"]["train"]["longest"]
    with pytest.raises(ConfigError, match=f"longer than data.seq_len=100 \\(the longest holds {longest} tokens\\)"):
        build_batch_source(sft_data(sft_dir, seq_len=100), seed=0)
    source = build_batch_source(sft_data(sft_dir, seq_len=100, too_long="skip"), seed=0)
    assert "leaving out the" in farsight_log.text
    assert all((source.train_batch(s, 0, 0)["labels"] != -100).sum(1).max() <= 100 for s in range(5))
    with pytest.raises(ConfigError, match="batch_tokens"):
        build_batch_source(sft_data(sft_dir, batch_tokens=100), seed=0)


def tiny_models():
    torch.manual_seed(0)
    small = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 2}
    return {
        "causal": TransformerForCausalLM(TransformerConfig(**small)),
        "sliding": TransformerForCausalLM(TransformerConfig(**small, attention="sliding", window=16)),
        "castle": TransformerForCausalLM(TransformerConfig(**small, attention="castle")),
        "drt": DRTForCausalLM(DRTConfig(**small, chunk_size=8, window=16, top_k=2, encoder_layers=1)),
    }


def test_the_loss_is_on_completion_tokens_only(sft_dir):
    model = tiny_models()["sliding"].eval()
    batch = build_batch_source(sft_data(sft_dir), seed=0).train_batch(0, 0, 0)
    base = model(**batch).loss
    weights = batch["loss_weights"]
    prompt = (weights == 0) & (batch["labels"] != -100)
    prompt[:, 0] = False  # (the first token is predicted by nothing)
    completion = weights > 0
    for where, changes in ((prompt, False), (completion, True)):
        row, col = [int(i) for i in where.nonzero()[len(where.nonzero()) // 2]]
        labels = batch["labels"].clone()
        labels[row, col] = (labels[row, col] + 1) % 256
        changed = model(batch["input_ids"], labels=labels, loss_weights=weights).loss
        assert (changed != base) == changes, (row, col)


@pytest.mark.parametrize("kind", ["causal", "sliding", "castle", "drt"])
def test_length_batching_equals_the_unpadded_per_example_losses(sft_dir, kind):
    model = tiny_models()[kind].eval()  # eval: no Gumbel noise in DRT's retrieval
    train = SFTSplit(sft_dir, "train")
    order = np.argsort(train.lengths)
    picked = [int(order[0]), int(order[len(order) // 2]), int(order[-1])]  # a short, a middle and the longest
    examples = [train.example(i) for i in picked]
    with torch.no_grad():
        padded = model(**pad_examples(examples, TOK.pad_id)).loss
        total = weight = 0.0
        for ids, mask in examples:
            one = pad_examples([(ids, mask)], TOK.pad_id)
            assert one["input_ids"].shape[1] == len(ids)  # alone: no padding at all
            n = float(mask[1:].sum())
            total += float(model(**one).loss) * n
            weight += n
    torch.testing.assert_close(padded, torch.tensor(total / weight), rtol=1e-5, atol=1e-5)


def test_cli_prepare_with_a_val_file_and_data_info(sft_dir, tmp_path, capsys):
    train, val = sft_dir.parent / "train.jsonl", sft_dir.parent / "val.jsonl"
    out = tmp_path / "d"
    argv = ["data", "prepare-sft", "--source", str(train), "--val", str(val), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "train 40 examples" in printed and "val 6 examples" in printed and "in the loss" in printed
    assert main([*argv, "--val-fraction", "0.1"]) == 2
    assert "pass one of the two" in capsys.readouterr().err
    assert main(["data", "info", str(out)]) == 0
    assert '"template": "farsight-chat-v1"' in capsys.readouterr().out


def test_prepare_takes_a_models_own_tokenizer(sft_dir, tmp_path, capsys):
    bpe = train_bpe_tokenizer([json.dumps(r) for r in pairs(40)] * 3, vocab_size=300)
    TransformerForCausalLM(TransformerConfig(vocab_size=300, d_model=16, n_layers=1, n_heads=2)).save_pretrained(
        tmp_path / "model", tokenizer=bpe
    )
    out = tmp_path / "d"
    argv = ["data", "prepare-sft", "--source", str(sft_dir.parent / "train.jsonl"), "--out", str(out)]
    assert main([*argv, "--tokenizer", str(tmp_path / "model")]) == 0
    splits = [SFTSplit(out, "train"), SFTSplit(out, "val")]
    assert splits[0].tokenizer.to_spec() == bpe.to_spec()
    prepared = {tuple(s.example(i)[0].tolist()) for s in splits for i in range(len(s))}
    assert prepared == {tuple(encode_segments(bpe, parse_record(r, "").segments)[0].tolist()) for r in pairs(40)}
