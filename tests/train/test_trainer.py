import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from farsight.config import ConfigError
from farsight.errors import MissingFileError
from farsight.models import DRTForCausalLM, load_model
from farsight.train.checkpoint import CheckpointError, list_checkpoints
from farsight.train.config import TrainConfig, apply_overrides, load_train_config
from farsight.train.trainer import GradientLost, Trainer, TrainingDiverged, lr_at, train
from tests.train.conftest import tiny_config, tiny_sft_config


def test_twenty_steps_lower_the_loss(token_dir, tmp_path):
    result = train(tiny_config(token_dir, tmp_path / "run", steps=20))
    assert result.status == "completed" and result.step == 20
    first = sum(loss for _, loss in result.losses[:3]) / 3
    last = sum(loss for _, loss in result.losses[-3:]) / 3
    assert last < first - 0.5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(records[0]) and any("val_loss" in r for r in records)
    assert all(r["device"] == "cpu" for r in records if "loss" in r)  # what a model card says it trained on
    model = load_model(tmp_path / "run")  # a run directory resolves to its newest checkpoint
    assert model.config.d_model == 32


def test_freed_memory_is_released_at_every_log_interval(token_dir, tmp_path, monkeypatch):
    import farsight.train.trainer as trainer_module

    trainer_module.release_freed_memory()  # glibc's malloc_trim here; a no-op elsewhere
    calls = []
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: calls.append(1))
    train(tiny_config(token_dir, tmp_path / "run", steps=6, log_interval=2))
    assert len(calls) == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rss_mb"] > 0 for r in records if "loss" in r)


def test_schedule_warmup_then_cosine_to_min():
    assert lr_at(0, 1.0, 0.1, 4, 20) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 0.1, 4, 20) == pytest.approx(1.0)
    assert lr_at(20, 1.0, 0.1, 4, 20) == pytest.approx(0.1)
    assert lr_at(12, 1.0, 0.1, 4, 20) == pytest.approx(0.55)


def _trainer(token_dir, out_dir, precision):
    trainer = Trainer(tiny_config(token_dir, out_dir, precision=precision))
    if precision == "fp16-mixed":
        # a loss scale at the edge of fp16's range that grows after every good step: steps
        # overflow and are skipped now and then, so a resume must restore the scaler's state
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**23, growth_interval=1)
    return trainer


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_interrupt_checkpoints_and_resume_is_bit_identical(token_dir, tmp_path, precision):
    straight = _trainer(token_dir, tmp_path / "a", precision).fit()

    trainer = _trainer(token_dir, tmp_path / "b", precision)
    step = trainer._train_step

    def step_then_ctrl_c():
        out = step()
        if trainer.step == 3:
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C delivers
        return out

    trainer._train_step = step_then_ctrl_c
    first = trainer.fit()
    assert first.status == "interrupted" and first.step == 3
    assert [s for s, _ in list_checkpoints(tmp_path / "b" / "checkpoints")] == [3]
    # a crash after the checkpoint: a record about to be redone and a line cut short
    with open(tmp_path / "b" / "metrics.jsonl", "a") as log:
        log.write('{"step": 4, "loss": 9.0}\n{"step": 5, "lo')

    resumed = train(tiny_config(token_dir, tmp_path / "b", precision=precision))
    assert resumed.status == "completed"
    losses = dict(first.losses) | dict(resumed.losses)
    assert losses == dict(straight.losses)  # exact equality, not approximate
    weights = load_file(resumed.checkpoint / "model.safetensors")
    expected = load_file(straight.checkpoint / "model.safetensors")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensor.dtype == torch.float32 and torch.equal(weights[name], tensor), name  # fp32 master weights
    records = [
        json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    assert [r["step"] for r in records] == list(range(1, 7))
    if precision == "fp16-mixed":
        assert 0 < records[-1]["skipped_steps"] < 6 and any(r["grad_norm"] is None for r in records)


# A DRT that draws random numbers at every step: Gumbel noise on the retrieval scores picks 2 of
# up to 7 past chunks (seq_len 32 in chunks of 4), so the losses after a resume depend on the
# restored RNG state. (farsight's models have no dropout: the noise is the only draw.)
GUMBEL_DRT = {
    "type": "drt",
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "chunk_size": 4,
    "window": 8,
    "top_k": 2,
    "encoder_layers": 1,
    "gumbel": True,
}


def test_resume_restores_the_rng_so_a_gumbel_drt_trains_bit_identically(token_dir, tmp_path, monkeypatch):
    def drt_config(out):
        config = tiny_config(token_dir, out)
        config.model = dict(GUMBEL_DRT)
        return config

    draws = []
    select = DRTForCausalLM._select
    monkeypatch.setattr(
        DRTForCausalLM, "_select", lambda self, scores: draws.append(scores.shape[-1]) or select(self, scores)
    )
    straight = Trainer(drt_config(tmp_path / "a")).fit()
    assert draws and max(draws) > GUMBEL_DRT["top_k"]  # more candidates than it keeps: the noise chooses

    trainer = Trainer(drt_config(tmp_path / "b"))
    step = trainer._train_step

    def step_then_ctrl_c():
        out = step()
        if trainer.step == 3:
            signal.raise_signal(signal.SIGINT)
        return out

    trainer._train_step = step_then_ctrl_c
    first = trainer.fit()
    assert first.status == "interrupted" and first.step == 3
    resumed = train(drt_config(tmp_path / "b"))  # a new process would start from the seed's RNG state
    assert resumed.status == "completed"
    assert dict(first.losses) | dict(resumed.losses) == dict(straight.losses)  # exact equality


def test_activation_checkpointing_recomputes_the_blocks_and_trains_a_gumbel_drt_the_same(token_dir, tmp_path):
    def drt_config(out, **train):
        config = tiny_config(token_dir, out, steps=3, **train)
        config.model = dict(GUMBEL_DRT)
        return config

    plain = Trainer(drt_config(tmp_path / "a")).fit()
    trainer = Trainer(drt_config(tmp_path / "b", activation_checkpointing=True))
    calls = []
    blocks = [*trainer.model.lower, *trainer.model.encoder, *trainer.model.upper]
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1) if torch.is_grad_enabled() else None)
    checkpointed = trainer.fit()
    assert len(calls) == 2 * 3 * len(blocks)  # each block twice a step: again, recomputed, in the backward
    for (step, loss), (plain_step, plain_loss) in zip(checkpointed.losses, plain.losses, strict=True):
        assert step == plain_step and loss == pytest.approx(plain_loss, rel=1e-6)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")  # the test wraps it
def test_grad_accumulation_averages_micro_batch_gradients(token_dir, tmp_path):
    import copy

    config = tiny_config(token_dir, tmp_path / "acc", steps=1, grad_accum=2)
    config.optim.grad_clip = None
    trainer = Trainer(config)
    before = copy.deepcopy(trainer.model)
    captured = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        captured.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    trainer.fit()
    losses = [before(**trainer.data.train_batch(0, micro, 0)).loss for micro in range(2)]
    ((losses[0] + losses[1]) / 2).backward()
    for name, p in before.named_parameters():
        torch.testing.assert_close(captured[name], p.grad, rtol=1e-5, atol=1e-7)


def test_keep_last_checkpoints(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "k", steps=5, checkpoint_interval=1, keep_last=2))
    assert [s for s, _ in list_checkpoints(tmp_path / "k" / "checkpoints")] == [4, 5]


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(token_dir, tmp_path):
    trainer = Trainer(tiny_config(token_dir, tmp_path / "nan", checkpoint_interval=1))
    forward = trainer.model.forward

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        if trainer.step == 2:
            out.loss = out.loss * float("nan")
        return out

    trainer.model.forward = poisoned
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3.*step_00000002"):
        trainer.fit()
    assert [s for s, _ in list_checkpoints(tmp_path / "nan" / "checkpoints")] == [1, 2]
    load_model(tmp_path / "nan")


def test_a_step_whose_gradient_vanished_everywhere_stops(token_dir, tmp_path):
    """A non-zero loss whose gradient reaches no parameter (as a compiled model that lost its
    autograd graph gave on a GPU) stops at that step instead of training a model that cannot learn."""
    trainer = Trainer(tiny_config(token_dir, tmp_path / "zero", checkpoint_interval=1))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for p in trainer.model.parameters():
        p.register_hook(torch.zeros_like)
    with pytest.raises(GradientLost, match=r"no parameter received a gradient at step 1 \(loss [0-9.]+"):
        trainer.fit()
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


def test_corrupted_checkpoint_is_reported(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "c", steps=2))
    state = tmp_path / "c" / "checkpoints" / "step_00000002" / "trainer_state.safetensors"
    state.write_bytes(state.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated"):
        train(tiny_config(token_dir, tmp_path / "c", steps=4))


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.safetensors"])
def test_a_same_size_corruption_is_caught_by_the_checksum_on_resume(token_dir, tmp_path, name):
    """Bytes flipped in the middle of a file (its tensor data, its length unchanged) pass the size
    check and still load: only the manifest's SHA-256 tells, so resuming must refuse it."""
    train(tiny_config(token_dir, tmp_path / "c", steps=2))
    file = tmp_path / "c" / "checkpoints" / "step_00000002" / name
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0x5A for b in data[middle : middle + 8])
    file.write_bytes(bytes(data))
    load_file(file)  # the flipped bytes are tensor data: the file still reads, and has its size
    with pytest.raises(CheckpointError, match=f"{name} does not match its checksum"):
        train(tiny_config(token_dir, tmp_path / "c", steps=4))


def test_a_finished_run_is_left_as_it_is_without_its_trainer_state(token_dir, tmp_path, farsight_log):
    train(tiny_config(token_dir, tmp_path / "f", steps=2))
    last = tmp_path / "f" / "checkpoints" / "step_00000002"
    (last / "trainer_state.safetensors").unlink()  # as shipped runs are committed: weights only
    (last / "trainer_state.json").unlink()
    result = train(tiny_config(token_dir, tmp_path / "f", steps=2))
    assert (result.status, result.step, result.checkpoint) == ("completed", 2, last)
    assert "is at step 2: nothing to train" in farsight_log.text


def test_a_weights_only_run_cannot_be_continued_and_says_how_to_train_on(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "w", steps=2))
    last = tmp_path / "w" / "checkpoints" / "step_00000002"
    (last / "trainer_state.safetensors").unlink()
    (last / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match=f"weights only .*train.init_from={last}"):
        train(tiny_config(token_dir, tmp_path / "w", steps=4))
    assert train(tiny_config(token_dir, tmp_path / "w2", steps=1, init_from=str(last))).status == "completed"


def test_a_run_continued_past_its_configs_steps_is_left_as_it_is(token_dir, tmp_path, farsight_log):
    train(tiny_config(token_dir, tmp_path / "r", steps=2))
    train(tiny_config(token_dir, tmp_path / "r", steps=4))  # continued, as with --set train.steps=4
    recorded = (tmp_path / "r" / "config.yaml").read_text()
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    result = train(tiny_config(token_dir, tmp_path / "r", steps=2))  # the config as written, run again
    assert (result.status, result.step, result.checkpoint.name) == ("completed", 4, "step_00000004")
    assert "is at step 4, past train.steps=2: nothing to train" in farsight_log.text
    assert (tmp_path / "r" / "config.yaml").read_text() == recorded and "steps: 4" in recorded
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics


def test_resume_refuses_another_model(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "m", steps=1))
    config = tiny_config(token_dir, tmp_path / "m", steps=2)
    config.model["d_model"] = 64
    with pytest.raises(ValueError, match="new train.out_dir"):
        train(config)


def test_a_finished_run_refuses_another_model_rather_than_saying_nothing_to_train(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "done", steps=1))
    config = tiny_config(token_dir, tmp_path / "done", steps=1)
    config.model["d_model"] = 64
    with pytest.raises(ValueError, match=r"finished training another model \(model.d_model 32 -> 64, .*\); use a new"):
        train(config)
    assert train(tiny_config(token_dir, tmp_path / "done", steps=1)).status == "completed"


def test_init_from_starts_with_the_source_weights(token_dir, tmp_path):
    train(tiny_config(token_dir, tmp_path / "source", steps=3))
    source = load_model(tmp_path / "source")
    trainer = Trainer(tiny_config(token_dir, tmp_path / "tuned", init_from=str(tmp_path / "source")))
    try:
        for name, tensor in source.state_dict().items():
            assert torch.equal(trainer.model.state_dict()[name], tensor), name
    finally:
        trainer.close()
    wider = tiny_config(token_dir, tmp_path / "wide", init_from=str(tmp_path / "source"))
    wider.model["d_model"] = 64
    with pytest.raises(ValueError, match="init_from.*other shapes"):
        Trainer(wider)
    other_type = tiny_config(token_dir, tmp_path / "drt", init_from=str(tmp_path / "source"))
    other_type.model = {"type": "drt", "d_model": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8, "window": 16}
    with pytest.raises(ValueError, match="holds a 'transformer' model"):
        Trainer(other_type)


def test_a_vocabulary_other_than_the_datas_is_named_with_its_tokenizer(token_dir, tmp_path, sft_dir):
    """Weights of another vocabulary (another tokenizer's data) are refused in one line that says
    so, for init_from and for a resume whose data was prepared again with another tokenizer."""
    import shutil

    from farsight.data.token_files import prepare_corpus
    from farsight.data.tokenizers import load_tokenizer

    wide = tiny_config(token_dir, tmp_path / "wide", steps=1)
    wide.model["vocab_size"] = 300  # what a tokenizer of 300 ids gives
    train(wide)
    with pytest.raises(
        ValueError, match=r"has a vocabulary of 300 tokens but the data's tokenizer gives 260: .*--tokenizer"
    ):
        Trainer(tiny_config(token_dir, tmp_path / "tuned", init_from=str(tmp_path / "wide")))
    data = tmp_path / "data"
    shutil.copytree(token_dir, data)
    train(tiny_config(data, tmp_path / "run", steps=1))
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a", "b", "c", "d"):
        (docs / f"{name}.txt").write_text(f"another text {name}, tokenized again " * 200)
    prepare_corpus([str(docs)], load_tokenizer("gpt2"), data, val_fraction=0.5, seed=0, progress=False)
    with pytest.raises(ValueError, match=r"has a vocabulary of 260 tokens but the data now gives 50259: .*--restart"):
        train(tiny_config(data, tmp_path / "run", steps=2), allow_data_change=True)
    with pytest.raises(ValueError, match=r"holds supervised examples .*set data.kind: sft"):
        Trainer(tiny_config(sft_dir, tmp_path / "sft-as-text"))


def test_a_warmup_as_long_as_the_run_is_noted(token_dir, tmp_path, farsight_log):
    train(tiny_config(token_dir, tmp_path / "short", steps=2))  # warmup_steps 2
    assert "optim.warmup_steps=2 is not below train.steps=2: the learning rate rises" in farsight_log.text
    farsight_log.clear()
    train(tiny_config(token_dir, tmp_path / "long", steps=3))
    assert "warmup_steps" not in farsight_log.text


def test_init_from_is_read_only_when_a_run_starts(token_dir, tmp_path, farsight_log):
    """A finished or resumed run keeps its own weights and never reads init_from (its source may be
    gone); --restart reads it again and trains exactly as a fresh run does."""
    train(tiny_config(token_dir, tmp_path / "source", steps=2))
    tuned = tiny_config(token_dir, tmp_path / "tuned", steps=2, init_from=str(tmp_path / "source"))
    train(tuned)
    assert "initialised the weights" in farsight_log.text
    farsight_log.clear()
    fresh = load_model(tmp_path / "tuned")
    (tmp_path / "source").rename(tmp_path / "moved")
    assert train(tuned).status == "completed"
    assert "nothing to train" in farsight_log.text and "initialised" not in farsight_log.text
    with pytest.raises(Exception, match="neither a model directory .* nor a training run"):
        train(tuned, resume=False)  # the source is read before anything is removed
    assert (tmp_path / "tuned" / "checkpoints" / "step_00000002").is_dir()
    (tmp_path / "moved").rename(tmp_path / "source")
    farsight_log.clear()
    assert train(tuned, resume=False).status == "completed"
    assert "initialised the weights" in farsight_log.text
    for name, tensor in load_model(tmp_path / "tuned").state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="farsight data prepare"):
        train(tiny_config(tmp_path / "nothing", tmp_path / "run"))


def test_config_file_and_overrides(tmp_path, token_dir):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{type: transformer, d_model: 32}}\ndata: {{path: {token_dir}}}\ntrain: {{steps: 5}}\n")
    config = load_train_config(path, ["train.steps=7", "optim.lr=0.01", "model.n_layers=3"])
    assert config.train.steps == 7 and config.optim.lr == 0.01 and config.model["n_layers"] == 3
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_train_config(path, ["train.step=7"])
    with pytest.raises(ConfigError, match="section"):
        apply_overrides({}, ["steps=3"])
    with pytest.raises(ConfigError, match="optim.lr must be > 0"):
        load_train_config(path, ["optim.lr=0"])


def test_a_config_with_a_base_changes_only_what_it_names(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model: {type: drt, d_model: 32, chunk_size: 8}\ndata: {path: d, curriculum: [[0, 64], [5, 128]]}\n"
        "optim: {lr: 0.01}\ntrain: {steps: 5, out_dir: runs/a}\n"
    )
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "child.yaml"
    child.write_text(
        "base: ../base.yaml\nmodel: {gumbel: false}\ndata: {curriculum: [[0, 32]]}\ntrain: {out_dir: runs/b}\n"
    )
    grandchild = tmp_path / "sub" / "grandchild.yaml"
    grandchild.write_text("base: child.yaml\noptim: {warmup_steps: 3}\n")
    config = load_train_config(grandchild, ["train.steps=9"])
    assert config.model == {"type": "drt", "d_model": 32, "chunk_size": 8, "gumbel": False}
    assert config.data == {"path": "d", "curriculum": [[0, 32]]}  # a list is replaced, not merged
    assert (config.optim.lr, config.optim.warmup_steps) == (0.01, 3)
    assert (config.train.steps, config.train.out_dir) == (9, "runs/b")
    (tmp_path / "loop.yaml").write_text("base: sub/loop2.yaml\n")
    (tmp_path / "sub" / "loop2.yaml").write_text("base: ../loop.yaml\n")
    with pytest.raises(ConfigError, match="leads back to loop.yaml; a config cannot be its own base"):
        load_train_config(tmp_path / "loop.yaml")
    child.write_text("base: missing.yaml\n")
    with pytest.raises(MissingFileError, match="child.yaml: its base .*missing.yaml does not exist; fix the base path"):
        load_train_config(child)
    child.write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="base must be the path of another config file"):
        load_train_config(child)
    # a model of another type, a data section of another kind: the base's section is replaced whole
    child.write_text(
        "base: ../base.yaml\nmodel: {type: transformer, attention: sliding, window: 16, d_model: 32}\n"
        "data: {kind: sft, path: e}\n"
    )
    config = load_train_config(child)
    assert config.model == {"type": "transformer", "attention": "sliding", "window": 16, "d_model": 32}
    assert config.data == {"kind": "sft", "path": "e"}
    child.write_text("base: ../base.yaml\nmodel: {type: drt, d_model: 64}\ndata: {kind: tokens}\n")
    config = load_train_config(child)  # the same type, and the kind the base has by default: merged
    assert config.model == {"type": "drt", "d_model": 64, "chunk_size": 8}
    assert config.data == {"kind": "tokens", "path": "d", "curriculum": [[0, 64], [5, 128]]}


def test_sigterm_from_outside_saves_and_exits(token_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {type: transformer, d_model: 32, n_layers: 2, n_heads: 2}\n"
        f"data: {{path: {token_dir}, seq_len: 32, batch_size: 4}}\n"
        # compile: false, or a run this long compiles its model (seconds) before its first step
        f"train: {{steps: 100000, out_dir: {tmp_path / 'run'}, checkpoint_interval: 100000, log_interval: 1,"
        " compile: false}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "farsight.cli", "train", str(cfg), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "checkpoint saved" in output
    assert list_checkpoints(tmp_path / "run" / "checkpoints")


CONFIGS_BY_KIND = {"tokens": tiny_config, "sft": tiny_sft_config}


def _ddp_worker(rank, world, port, kind, data_dir, out_dir, result_dir):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    trainer = Trainer(CONFIGS_BY_KIND[kind](data_dir, out_dir, steps=2))
    trainer.fit()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    torch.save(flat, os.path.join(result_dir, f"rank{rank}.pt"))
    trainer.close()


@pytest.mark.parametrize("kind", ["tokens", "sft"])
def test_ddp_two_processes_keep_identical_parameters(token_dir, sft_dir, tmp_path, kind):
    import socket

    import torch.multiprocessing as mp

    data_dir = {"tokens": token_dir, "sft": sft_dir}[kind]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        _ddp_worker, args=(2, port, kind, str(data_dir), str(tmp_path / "ddp"), str(tmp_path)), nprocs=2, join=True
    )
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.equal(a, b)
    single = Trainer(CONFIGS_BY_KIND[kind](data_dir, tmp_path / "single", steps=2))
    before = torch.cat([p.detach().flatten() for p in single.model.parameters()])
    assert not torch.equal(a, before)  # the ranks did train


def _fsdp_worker(rank, port, token_dir, out_dir, steps, result_dir):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    trainer = Trainer(tiny_config(token_dir, out_dir, steps=steps, distributed="fsdp"))
    result = trainer.fit()
    torch.save(dict(result.losses), os.path.join(result_dir, f"{os.path.basename(out_dir)}-{steps}-{rank}.pt"))
    trainer.close()


def test_fsdp_checkpoints_gather_full_weights_and_resume(token_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    for out, steps in (("straight", 4), ("resumed", 2), ("resumed", 4)):
        mp.spawn(
            _fsdp_worker, args=(port(), str(token_dir), str(tmp_path / out), steps, str(tmp_path)), nprocs=2, join=True
        )
    model = load_model(tmp_path / "resumed")
    assert model.lm_head.weight is model.embed.weight
    straight = torch.load(tmp_path / "straight-4-0.pt")
    assert len(straight) == 4
    assert torch.load(tmp_path / "resumed-2-0.pt") | torch.load(tmp_path / "resumed-4-1.pt") == straight


def test_answer_counts_score_only_the_up_weighted_tokens():
    from farsight.train.trainer import answer_counts

    labels = torch.tensor([[5, 1, 2, 3, 9], [5, 6, 7, 8, 9]])
    weights = torch.ones(2, 5)
    weights[0, 2:4] = 10.0  # row 0's answer: labels 2, 3 (predicted at positions 1, 2)
    logits = torch.zeros(2, 5, 12)
    logits[0, 1, 2] = 1.0  # right
    logits[0, 2, 4] = 1.0  # wrong (3 expected)
    assert answer_counts(logits, labels, weights > 1).tolist() == [1, 2, 0, 1]
    logits[0, 2, 3] = 2.0
    assert answer_counts(logits, labels, weights > 1).tolist() == [2, 2, 1, 1]  # row 1 has no answer: not counted


def test_needle_training_logs_answer_accuracy_and_lm_training_does_not(token_dir, tmp_path):
    raw = tiny_config(token_dir, tmp_path / "lm", steps=2, eval_interval=2).to_dict()
    train(TrainConfig.from_dict(raw))
    lm_val = [
        r for r in map(json.loads, (tmp_path / "lm" / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r
    ]
    assert lm_val and "val_answer_exact" not in lm_val[-1]
    raw["data"] = {"kind": "needle", "filler": "repeat", "seq_len": 128, "batch_tokens": 256}
    raw["train"]["out_dir"] = str(tmp_path / "needle")
    train(TrainConfig.from_dict(raw))
    val = [
        r for r in map(json.loads, (tmp_path / "needle" / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r
    ][-1]
    assert 0 <= val["val_answer_exact"] <= val["val_answer_token_acc"] <= 1


def test_supervised_retrieval_is_trained_and_logged_beside_the_language_models_loss(token_dir, tmp_path):
    raw = tiny_config(token_dir, tmp_path / "run", steps=2, eval_interval=2, log_interval=1).to_dict()
    raw["model"] = {"type": "drt", "d_model": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8, "window": 16}
    raw["data"] = {"kind": "needle", "filler": "repeat", "seq_len": 256, "batch_tokens": 512, "retrieval_weight": 1.0}
    train(TrainConfig.from_dict(raw))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(r["retrieval_loss"] > 0 and 0 <= r["retrieval_found"] <= 1 for r in steps)
    val = [r for r in records if "val_loss" in r][-1]
    assert val["val_retrieval_loss"] > 0 and 0 <= val["val_retrieval_found"] <= 1
    # the logged loss is the language model's alone: the same as a run without supervision at its first step
    raw["data"]["retrieval_weight"] = 0.0
    raw["train"]["out_dir"] = str(tmp_path / "plain")
    train(TrainConfig.from_dict(raw))
    plain = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert plain[0]["loss"] == pytest.approx(steps[0]["loss"], rel=1e-6) and "retrieval_loss" not in plain[0]


def test_supervised_retrieval_for_a_model_without_a_learned_retriever_is_refused(token_dir, tmp_path):
    raw = tiny_config(token_dir, tmp_path / "run", steps=1).to_dict()
    raw["data"] = {"kind": "needle", "filler": "repeat", "seq_len": 128, "batch_tokens": 256, "retrieval_weight": 1.0}
    with pytest.raises(
        ConfigError, match="data.retrieval_weight=1 supervises a learned retriever, which this 'transformer' model"
    ):
        train(TrainConfig.from_dict(raw))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("model", ["sliding", "drt"])
def test_supervised_examples_train_and_log_completion_accuracy(sft_dir, tmp_path, farsight_log, precision, model):
    config = tiny_sft_config(sft_dir, tmp_path / "run", steps=3, eval_interval=3, precision=precision)
    if model == "drt":
        config.model = {"type": "drt", "d_model": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8, "window": 16}
    else:
        config.model |= {"attention": "sliding", "window": 16}
    result = train(config)
    assert result.status == "completed" and all(math.isfinite(loss) for _, loss in result.losses)
    assert f"training in {precision} on cpu" in farsight_log.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r][-1]
    assert math.isfinite(val["val_loss"]) and 0 <= val["val_answer_exact"] <= val["val_answer_token_acc"] <= 1
    assert load_model(result.checkpoint).num_parameters() > 0
