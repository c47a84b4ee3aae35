"""Training on packed batches (data.pack): `farsight train` feeds document_ids to the model, logs
the tokens with a label beside all the tokens it computes, scores packed held-out examples one by
one, and a resume notices data.pack switched."""

import json
import math

import pytest
import torch
import yaml

from farsight.cli import main
from farsight.config import ConfigError
from farsight.data.batches import build_batch_source
from farsight.models import TransformerForCausalLM
from farsight.train.config import TrainConfig
from farsight.train.trainer import answer_counts, train
from tests.train.conftest import tiny_config, tiny_sft_config


def records_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["tokens", "sft"])
def test_farsight_train_with_packed_batches_feeds_document_ids_to_the_model(
    token_dir, sft_dir, tmp_path, monkeypatch, kind
):
    make = {"tokens": lambda out: tiny_config(token_dir, out), "sft": lambda out: tiny_sft_config(sft_dir, out)}[kind]
    raw = make(tmp_path / "run").to_dict()
    raw["data"]["pack"] = True
    if kind == "tokens":
        raw["data"]["seq_len"] = 512  # windows of documents of about 1,800 tokens: some span two
    raw["model"] |= {"attention": "sliding", "window": 16}
    raw["train"] |= {"steps": 3, "eval_interval": 3, "eval_batches": 2}
    path = tmp_path / "packed.yaml"
    path.write_text(yaml.safe_dump(raw))
    seen = []
    forward = TransformerForCausalLM.forward

    def spy(self, input_ids, *args, **kwargs):
        seen.append(kwargs.get("document_ids"))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(TransformerForCausalLM, "forward", spy)
    assert main(["train", "-q", str(path)]) == 0
    assert len(seen) == 3 + 2 and all(isinstance(ids, torch.Tensor) for ids in seen)  # 3 steps, 2 held-out batches
    assert any(bool((ids > 0).any()) for ids in seen)  # rows holding several documents
    records = records_of(tmp_path / "run")
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) for r in steps)
    assert all(0 < r["real_tokens"] <= r["tokens"] and r["real_tokens_per_s"] > 0 for r in steps)
    val = [r for r in records if "val_loss" in r][-1]
    assert math.isfinite(val["val_loss"])
    if kind == "sft":
        assert 0 <= val["val_answer_exact"] <= val["val_answer_token_acc"] <= 1


def test_real_tokens_count_the_labelled_tokens_and_tokens_every_position(sft_dir, tmp_path):
    config = tiny_sft_config(sft_dir, tmp_path / "run", steps=4, grad_accum=2)
    train(config)
    source = build_batch_source(config.data, config.train.seed, config.model)
    batches = [source.train_batch(step, micro, 0) for step in range(4) for micro in range(2)]
    steps = [r for r in records_of(tmp_path / "run") if "loss" in r]
    assert steps[-1]["tokens"] == sum(b["input_ids"].numel() for b in batches)
    assert steps[-1]["real_tokens"] == sum(int((b["labels"] != -100).sum()) for b in batches)
    assert steps[-1]["real_tokens"] < steps[-1]["tokens"]  # length buckets pad
    for r in steps:  # the same interval: the rates stand as the counts do
        assert r["real_tokens_per_s"] <= r["tokens_per_s"]


def test_a_resume_that_switches_data_pack_is_refused(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "run", steps=2))
    raw = tiny_config(token_dir, tmp_path / "run", steps=4).to_dict()
    raw["data"]["pack"] = True
    with pytest.raises(ConfigError, match=r"data.pack False -> True"):
        train(TrainConfig.from_dict(raw))
    raw["data"]["pack"] = False  # spelled out, it is what the run trained with
    assert train(TrainConfig.from_dict(raw)).step == 4


def test_answer_counts_score_each_packed_example_on_its_own():
    labels = torch.tensor([[5, 1, 2, 7, 3, 4, 0]])
    answer = torch.tensor([[0, 1, 1, 0, 1, 1, 0]]).bool()  # example 0: labels 1, 2; example 1: labels 3, 4
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 2]])  # and the padding
    logits = torch.zeros(1, 7, 12)
    for position, token in ((0, 1), (1, 2), (3, 3), (4, 9)):  # example 0 all right, example 1 half
        logits[0, position, token] = 1.0
    assert answer_counts(logits, labels, answer).tolist() == [3, 4, 0, 1]  # the row as one
    assert answer_counts(logits, labels, answer, documents).tolist() == [3, 4, 1, 2]
    assert answer_counts(logits, labels, answer, torch.zeros_like(documents)).tolist() == [3, 4, 0, 1]


def test_packed_training_compiled_follows_the_eager_losses(token_dir, tmp_path):
    losses = {}
    for compiled in (True, False):
        raw = tiny_config(token_dir, tmp_path / f"run-{compiled}", steps=2, compile=compiled).to_dict()
        raw["data"] |= {"pack": True, "seq_len": 256}
        raw["model"] |= {"attention": "sliding", "window": 16}
        losses[compiled] = [loss for _, loss in train(TrainConfig.from_dict(raw)).losses]
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-4)


def _ddp_worker(rank, port, sft_dir, out_dir):
    import os

    from farsight.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    raw = tiny_sft_config(sft_dir, out_dir, steps=2).to_dict()
    raw["data"]["pack"] = True
    trainer = Trainer(TrainConfig.from_dict(raw))
    trainer.fit()
    torch.save(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]), f"{out_dir}-{rank}.pt")
    trainer.close()


def test_ddp_ranks_train_on_packed_rows_alike_and_count_every_ranks_tokens(sft_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "ddp"
    mp.spawn(_ddp_worker, args=(port, str(sft_dir), str(out)), nprocs=2, join=True)
    assert torch.equal(torch.load(f"{out}-0.pt"), torch.load(f"{out}-1.pt"))
    raw = tiny_sft_config(sft_dir, out, steps=2).to_dict()
    raw["data"]["pack"] = True
    source = build_batch_source(raw["data"], 0, raw["model"])
    batches = [source.train_batch(step, 0, rank) for step in range(2) for rank in range(2)]
    last = [r for r in records_of(out) if "loss" in r][-1]
    assert last["tokens"] == sum(b["input_ids"].numel() for b in batches)  # rows of other widths on each rank
    assert last["real_tokens"] == sum(int((b["labels"] != -100).sum()) for b in batches)
