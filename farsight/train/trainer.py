"""The training loop behind `farsight train CONFIG.yaml`.

AdamW (decay on matrices only), linear warmup + cosine decay to min_lr, gradient clipping and
accumulation, fp32 / bf16-mixed / fp16-mixed (loss-scaled) / pure bf16 precision
(farsight.train.precision), torchrun DDP/FSDP, atomic checkpoints that resume to the
bit-identical loss curve, graceful Ctrl-C/SIGTERM, and a stop with a clear message on a
non-finite loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from farsight.data.batches import build_batch_source
from farsight.errors import ConfigError, FarsightError, InputTypeError, MissingDependencyError
from farsight.files import claim_output_folder, folder_lock
from farsight.models import PretrainedLM, build_model, load_weights, read_model_meta, resolve_model_dir
from farsight.ops.documents import document_starts
from farsight.process_memory import current_rss_bytes, release_freed_memory
from farsight.progress import progress_bar
from farsight.train import distributed as dist_utils
from farsight.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_trainer_state,
    remove_checkpoints,
    save_checkpoint,
    write_text_atomically,
)
from farsight.train.compile import (
    AUTO_MIN_STEPS,
    CompileClock,
    CompiledModel,
    compile_model,
    eager,
    failure_note,
    resolve_compile,
)
from farsight.train.config import TrainConfig, dump_train_config
from farsight.train.metrics import read_metrics
from farsight.train.precision import flush_denormals, precision_note, resolve_precision, widens_products

# Under fp16-mixed an overflowing step is skipped and the loss scale halved; gradients that
# still overflow below this scale are not an fp16 range problem, and the run stops as diverged.
MIN_LOSS_SCALE = 1.0

# Fields that steer how a run is carried out, not what it trains: a resume takes their new
# values (and says so). Any other change (optim, data, train.seed, train.grad_accum) is refused
# unless asked for with --allow-config-change; a change to the model section is always refused.
RESUME_FREE_FIELDS = frozenset(
    f"train.{name}"
    for name in (
        "steps",
        "out_dir",
        "log_interval",
        "eval_interval",
        "eval_batches",
        "checkpoint_interval",
        "keep_last",
        "device",
        "precision",
        "compile",
        "activation_checkpointing",
        "distributed",
        "tensorboard",
        "progress",
        "init_from",
    )
)

logger = logging.getLogger(__name__)


class TrainingDiverged(FarsightError, RuntimeError):
    """The loss or gradient became NaN/inf; nothing was updated and the last checkpoint is intact."""


class GradientLost(FarsightError, RuntimeError):
    """A step with a non-zero loss gave every parameter a zero (or no) gradient: the model would
    not learn. Nothing was updated. Seen with a compiled model whose autograd graph was lost."""


@dataclass
class TrainResult:
    status: str  # "completed" or "interrupted"
    step: int
    checkpoint: Path | None
    losses: list[tuple[int, float]] = field(default_factory=list)


def answer_counts(
    logits: torch.Tensor, labels: torch.Tensor, answer: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """[answer tokens predicted right, answer tokens, rows with all of them right, rows with any]
    for logits [B, T, V]; `answer` [B, T] marks the answer tokens among the labels (position t
    predicts labels[t + 1], as in the loss). With `document_ids` [B, T] (packed rows) each
    document of a row counts as a row of its own: an example is right when all its answer is."""
    answer = answer[:, 1:].bool()
    right = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & answer
    if document_ids is None:
        rows = answer.any(1)
        all_right = (right.sum(1) == answer.sum(1)) & rows
        return torch.stack([right.sum(), answer.sum(), all_right.sum(), rows.sum()])
    # one group per (row, document) of the predicted tokens, numbered in order along the rows
    starts = document_starts(document_ids[:, 1:])
    group = starts.flatten().long().cumsum(0) - 1
    size = int(starts.sum())
    answers = torch.zeros(size, dtype=torch.long, device=answer.device).index_add_(0, group, answer.flatten().long())
    rights = torch.zeros(size, dtype=torch.long, device=answer.device).index_add_(0, group, right.flatten().long())
    rows = answers > 0
    all_right = (rights == answers) & rows
    return torch.stack([right.sum(), answer.sum(), all_right.sum(), rows.sum()])


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from lr to min_lr at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for the fields of `saved` that `current` changes."""
    old, new = _flatten(saved), _flatten(current)
    return {key: (value, new[key]) for key, value in old.items() if key in new and new[key] != value}


def _data_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A training config's dict with its data section spelled out, every field the data kind's
    defaults fill in included (e.g. data.pack: false), so that a resume compares what the batches
    are made of rather than what the files wrote; as it was where the section no longer validates."""
    from farsight.data.batches import DATA_KINDS

    data = config.get("data")
    if not isinstance(data, dict):
        return config
    kind = data.get("kind", "tokens")
    try:
        fields = DATA_KINDS[kind][0].from_dict({k: v for k, v in data.items() if k != "kind"}, where="data")
    except (KeyError, ConfigError):
        return config
    return config | {"data": {"kind": kind, **fields.to_dict()}}


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device={name} but this machine has no usable CUDA device; set train.device to auto or cpu"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def device_name(device: torch.device) -> str:
    """What a run's metrics record as its device: the GPU's name, or the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class _StopRequest:
    """First Ctrl-C/SIGTERM asks the loop to checkpoint and stop; a second one aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _retrieval_sums(out: Any) -> torch.Tensor:
    """A forward's supervised retrieval as float64 [3]: its loss, its share found (0 where nothing
    was to be found: the share is nan), and 1 where that share counts; summed over batches, the
    mean share is the second over the third."""
    found = out.retrieval_found.detach().double()
    return torch.stack([out.retrieval_loss.detach().double(), found.nan_to_num(0.0), torch.isfinite(found).double()])


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        if not isinstance(config, TrainConfig):
            raise InputTypeError(
                f"training takes a TrainConfig, got {type(config).__name__}; build one with "
                "farsight.train.config.load_train_config('run.yaml') or TrainConfig.from_dict(mapping)"
            )
        self.config = config
        run = config.train
        self.out_dir = Path(run.out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ConfigError(
                f"train.out_dir={run.out_dir} is a file, not a directory; set train.out_dir to a run directory"
            )
        self.ckpt_root = self.out_dir / "checkpoints"
        probe = resolve_device(run.device, 0)
        self.ctx = dist_utils.init_distributed(probe.type)
        self.device = resolve_device(run.device, self.ctx.local_rank)
        self.device_name = device_name(self.device)  # logged with every interval's metrics
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision(run.precision, self.device)
        torch.manual_seed(run.seed)
        np.random.seed(run.seed)
        random.seed(run.seed)
        self.data = build_batch_source(config.data, run.seed, config.model)
        self.tokenizer = self.data.tokenizer
        self.model: PretrainedLM = build_model(config.model, self.tokenizer).to(self.device)
        self.retrieval_weight = float(getattr(self.data, "retrieval_weight", 0.0))
        if self.retrieval_weight and getattr(self.model.config, "retriever", None) != "learned":
            raise ConfigError(
                f"data.retrieval_weight={self.retrieval_weight:g} supervises a learned retriever, which this "
                f"{self.model.model_type!r} model does not have; set data.retrieval_weight: 0 or train a drt"
            )
        # A run with checkpoints resumes (or is finished): its own weights win, so init_from is read
        # only if fit starts it over (--restart), and a source deleted since is no obstacle.
        self._deferred_init = run.init_from if run.init_from and list_checkpoints(self.ckpt_root) else None
        if run.init_from and not self._deferred_init:
            self._init_weights(run.init_from)
        self.precision.cast_parameters(self.model)
        # before wrapping: the checkpointed blocks are the native model's, under DDP/FSDP too
        self.model.set_activation_checkpointing(run.activation_checkpointing)
        self.wrapped = dist_utils.wrap_model(self.model, self.ctx, run.distributed, self.device)
        use_compile, self.compile_note = resolve_compile(
            run.compile,
            self.device,
            run.steps,
            self._sharded,
            widens_products(self.precision, self.device),
            varying_shapes=getattr(self.data, "varying_shapes", False),
        )
        self.compiled: CompiledModel | None = compile_model(self.model) if use_compile else None
        self.compile_clock = CompileClock()
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        opt = config.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            **self._optimizer_kernel(),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_at(s, opt.lr, opt.min_lr, opt.warmup_steps, run.steps) / opt.lr
        )
        self.scaler = self.precision.grad_scaler(self.device)
        self.step = 0
        self.tokens_seen = 0
        # the tokens with a label (not -100): tokens_seen less the padding of supervised examples;
        # None after resuming a checkpoint of an older farsight, which did not count them
        self.real_tokens_seen: int | None = 0
        self._step_real_tokens = 0  # of the last step (all ranks)
        # of the last step with data.retrieval_weight: supervised retrieval's loss and share found
        self._step_retrieval: dict[str, float] = {}
        self.skipped_steps = 0
        self._compile_checked = False
        self._data_digests: dict[str, str] | None = None

    def _optimizer_kernel(self) -> dict[str, bool]:
        """AdamW's implementation: the fused kernel on a CPU (3x faster than foreach for a
        d_model-256 model's 6.6M parameters, and the same update up to the rounding of its fused
        arithmetic), foreach elsewhere and under FSDP."""
        if self.device.type == "cpu" and not self._sharded:
            return {"fused": True, "foreach": False}
        return {"foreach": True}

    def _init_weights(self, source: str) -> None:
        """Start from the weights of another run or model directory (a resume overrides them)."""
        path = resolve_model_dir(source)
        meta = read_model_meta(path)
        if meta["model_type"] != self.model.model_type:
            raise ConfigError(
                f"train.init_from={source} holds a {meta['model_type']!r} model, but model.type is {self.model.model_type!r}; "
                f"set model.type: {meta['model_type']} and its sizes, or start from a {self.model.model_type!r} model"
            )
        vocabulary = meta["config"].get("vocab_size")
        if vocabulary != self.model.config.vocab_size:
            raise ConfigError(
                f"train.init_from={source} has a vocabulary of {vocabulary} tokens but the data's tokenizer gives "
                f"{self.model.config.vocab_size}: the data was prepared with another tokenizer; prepare it with "
                f"`farsight data prepare --tokenizer {source} ...` (or set model.vocab_size: {vocabulary} if its tokenizer fits)"
            )
        try:
            load_weights(self.model, path, self.device)
        except ValueError as exc:
            raise ConfigError(f"train.init_from={source} does not fit the model section: {exc}") from exc
        if self.ctx.is_main:
            logger.info(f"initialised the weights from {path}")

    # ---- checkpoints -------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.ctx.enabled and self.config.train.distributed == "fsdp"

    def _full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Model and optimizer state as plain full tensors (gathered from every rank under FSDP)."""
        if not self._sharded:
            return self.model.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.wrapped, options=options), get_optimizer_state_dict(
            self.wrapped, self.optimizer, options=options
        )

    def _state(self, optimizer: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "real_tokens_seen": self.real_tokens_seen,
            "precision": self.precision.name,
            "skipped_steps": self.skipped_steps,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(self.device),
            "config": self.config.to_dict(),
            "world_size": self.ctx.world_size,
            "data_fingerprint": self.data_digests(),
        }

    def data_digests(self) -> dict[str, str]:
        """{config key: hash} of the files the batches come from (farsight.data's `digests`),
        computed once: a checkpoint records it and a resume compares it."""
        if self._data_digests is None:
            self._data_digests = dict(getattr(self.data, "digests", dict)())
        return self._data_digests

    def save(self) -> Path | None:
        path = None
        model_state, optimizer_state = self._full_state()  # a collective under FSDP
        if self.ctx.is_main:
            path = save_checkpoint(
                self.ckpt_root,
                self.step,
                lambda d: self.model.save_pretrained(d, tokenizer=self.tokenizer, state_dict=model_state),
                self._state(optimizer_state),
                self.config.train.keep_last,
            )
            logger.debug(f"step {self.step}: checkpoint saved to {path}")
        dist_utils.barrier(self.ctx)
        return path

    def latest_checkpoint(self) -> Path | None:
        found = list_checkpoints(self.ckpt_root)
        return found[-1][1] if found else None

    def resume(self, allow_config_change: bool = False, allow_data_change: bool = False) -> bool:
        path = self.latest_checkpoint()
        if path is None:
            return False
        state = load_trainer_state(path)
        if state["config"]["model"] != self.config.model:
            raise ConfigError(
                f"{path} was trained with model config {state['config']['model']}, not {self.config.model}; "
                "use a new train.out_dir or restore the original model section"
            )
        changes = config_changes(_data_defaults(state["config"]), _data_defaults(self.config.to_dict()))
        guarded = [key for key in changes if key not in RESUME_FREE_FIELDS]
        if guarded and not allow_config_change:
            listed = ", ".join(f"{key} {changes[key][0]!r} -> {changes[key][1]!r}" for key in guarded)
            raise ConfigError(
                f"the config differs from the one {path} was trained with: {listed}; restore those values, "
                "pass --allow-config-change to continue the run with the new ones, or --restart to start over"
            )
        data_changes = self._data_changes(path, state, allow_data_change or any(k.startswith("data.") for k in guarded))
        vocabulary = read_model_meta(path)["config"].get("vocab_size")
        if vocabulary != self.model.config.vocab_size:
            raise ConfigError(
                f"{path} has a vocabulary of {vocabulary} tokens but the data now gives {self.model.config.vocab_size}: "
                "it was prepared again with another tokenizer, which a resumed run cannot take; resume on data prepared "
                f"with the checkpoint's tokenizer (`farsight data prepare --tokenizer {path} ...`), or --restart "
                "(or a new train.out_dir) to start over"
            )
        from safetensors import SafetensorError

        try:
            self._load_weights_and_optimizer(path, state["optimizer"])
        except SafetensorError as exc:
            raise CheckpointError(
                f"cannot read {path / 'model.safetensors'} ({exc}); delete {path} to resume from an earlier checkpoint"
            ) from exc
        self.scheduler.load_state_dict(state["scheduler"])
        # None when the checkpoint was trained without a loss scale (anything but fp16-mixed)
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        _set_rng_state(state["rng"], self.device)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        real = state.get("real_tokens_seen")
        self.real_tokens_seen = real if isinstance(real, int) and not isinstance(real, bool) else None
        self.skipped_steps = state.get("skipped_steps", 0)
        previous = state.get("precision")
        if previous not in (None, self.precision.name) and self.ctx.is_main:
            logger.info(f"{path} was trained in {previous}; continuing in {self.precision.name}")
        if changes:
            self._apply_optim_config()
            if self.ctx.is_main:
                for key, (old, new) in changes.items():
                    logger.info(f"config change on resume: {key} {old!r} -> {new!r} (from step {self.step + 1})")
        if self.ctx.is_main:
            for key in data_changes:
                logger.info(
                    f"data change on resume: the files at {key}={self.config.data.get(key[5:])} differ from those "
                    f"{path.name} was trained on (from step {self.step + 1})"
                )
        return True

    def _check_finished_model(self, checkpoint: Path) -> None:
        """Refuse, as a resume does, a model section other than the one a finished run was trained
        with (its newest checkpoint's config.json): "nothing to train" would otherwise read as
        the new model being trained already."""
        built = self.model.config.to_dict()
        # through the config class, so that a field added since the run was saved takes its default there too
        trained = type(self.model.config).from_dict(read_model_meta(checkpoint)["config"], where="config").to_dict()
        changed = sorted(key for key in built.keys() | trained.keys() if built.get(key) != trained.get(key))
        if changed:
            more = f", and {len(changed) - 4} more" if len(changed) > 4 else ""
            listed = ", ".join(f"model.{key} {trained.get(key)!r} -> {built.get(key)!r}" for key in changed[:4]) + more
            raise ConfigError(
                f"{self.out_dir} finished training another model ({listed}); use a new train.out_dir, or restore the "
                "original model section"
            )

    def _data_changes(self, path: Path, state: dict[str, Any], allowed: bool) -> list[str]:
        """The config keys (data.path, data.corpus) whose files differ from those the checkpoint
        `path` recorded; refused (ConfigError) unless `allowed`. A checkpoint of an older farsight
        recorded none: a note, and nothing to compare."""
        saved = state.get("data_fingerprint")
        if saved is None:
            if self.ctx.is_main:
                logger.info(
                    f"note: {path} records no fingerprint of its training data (an older farsight's checkpoint); "
                    "resuming without checking that the data is unchanged"
                )
            return []
        current = self.data_digests()
        changed = sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))
        if changed and not allowed:
            where = ", ".join(f"{key}={self.config.data.get(key[5:])}" for key in changed)
            raise ConfigError(
                f"the data at {where} is not what {path} was trained on (its token files were prepared again, "
                "from other text or with other settings); resume on the original data, pass --allow-data-change to "
                "continue on the new data, or --restart (or a new train.out_dir) to start over"
            )
        return changed

    def _load_weights_and_optimizer(self, path: Path, optimizer: dict[str, Any]) -> None:
        if self._sharded:
            from safetensors.torch import load_file
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            weights = load_file(path / "model.safetensors")
            set_state_dict(
                self.wrapped,
                self.optimizer,
                model_state_dict=weights,
                optim_state_dict=optimizer,
                options=StateDictOptions(full_state_dict=True, strict=False),
            )
        else:
            from safetensors.torch import load_model

            load_model(self.model, path / "model.safetensors", device=str(self.device))
            self.optimizer.load_state_dict(optimizer)
        # a checkpoint's param groups carry the implementation flags it was saved with
        for group in self.optimizer.param_groups:
            group.update(fused=None, foreach=None)
            group.update(self._optimizer_kernel())

    def _apply_optim_config(self) -> None:
        """Put the config's optimizer settings and lr schedule in place of the ones a checkpoint restored."""
        opt = self.config.optim
        for group, decay in zip(self.optimizer.param_groups, (opt.weight_decay, 0.0)):
            group.update(betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=decay, initial_lr=opt.lr)
        self.scheduler.base_lrs = [opt.lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = opt.lr * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # ---- loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out loss; for batches with answer tokens (needle tasks: the up-weighted tokens;
        supervised examples: the completions, the batch's `answer_mask`) also the share of answer
        tokens predicted right (teacher-forced argmax) and of rows with every answer token right:
        what tells whether retrieval is being learnt, which the loss over whole haystacks hides.
        With supervised retrieval (data.retrieval_weight) also its loss and the share of the
        supervised retrievals whose top k held the evidence."""
        n = self.config.train.eval_batches
        if n == 0:
            return None
        self.model.eval()
        # loss sum, batches, answer tokens right, answer tokens, rows all right, answer rows, then with
        # supervised retrieval its _retrieval_sums
        sums = torch.zeros(9, dtype=torch.float64, device=self.device)
        for i in range(n):
            batch = {k: v.to(self.device) for k, v in self.data.eval_batch(i).items()}
            answer = batch.pop("answer_mask", None)
            documents = batch.get("document_ids")
            if answer is None and "loss_weights" in batch:
                answer = batch["loss_weights"] > 1
            # eagerly: a few batches do not pay for compiling the blocks' inference graphs
            with eager(self.compiled), self.precision.matmuls(self.device), self.precision.autocast(self.device):
                out = self.model(**batch)
            sums[0] += float(out.loss)
            sums[1] += 1
            if answer is not None:
                sums[2:6] += answer_counts(out.logits, batch["labels"], answer, documents).to(sums)
            if out.retrieval_loss is not None:
                sums[6:] += _retrieval_sums(out)
        self.model.train()
        sums = dist_utils.all_reduce_sum(sums, self.ctx)
        result = {"val_loss": float(sums[0] / sums[1])}
        if sums[3] > 0:
            result["val_answer_token_acc"] = float(sums[2] / sums[3])
            result["val_answer_exact"] = float(sums[4] / sums[5])
        if self.retrieval_weight:
            result["val_retrieval_loss"] = float(sums[6] / sums[1])
            if sums[8] > 0:
                result["val_retrieval_found"] = float(sums[7] / sums[8])
        return result

    def _gradients(self) -> tuple[torch.Tensor, int]:
        """Forward and backward over the step's grad_accum micro-batches: (summed loss, tokens);
        the tokens with a label in `self._step_real_tokens`. The first compiled step falls back to
        eager (one note) if compiling fails."""
        if self.compiled is None or self._compile_checked:
            return self._accumulate()
        rng = _rng_state(self.device)
        try:
            result = self._accumulate()
        except (KeyboardInterrupt, FarsightError):
            raise
        except Exception as exc:
            if self.ctx.is_main:
                logger.warning(failure_note(exc))
            self.compiled.remove()
            self.compiled = None
            _set_rng_state(rng, self.device)
            return self._accumulate()
        self._compile_checked = True
        return result

    def _accumulate(self) -> tuple[torch.Tensor, int]:
        run = self.config.train
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        retrieval = torch.zeros(3, dtype=torch.float64, device=self.device)  # _retrieval_sums over the micro-batches
        tokens = 0
        self._step_real_tokens = 0
        for micro in range(run.grad_accum):
            batch = self.data.train_batch(self.step, micro, self.ctx.rank)
            # every position the model computes, and those with a label (not padding), counted on the host
            tokens += batch["input_ids"].numel()
            self._step_real_tokens += int((batch.get("labels", batch["input_ids"]) != -100).sum())
            # document_ids (packed rows) and loss_weights go to the model with the rest
            batch = {k: v.to(self.device) for k, v in batch.items() if k != "answer_mask"}
            last = micro == run.grad_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.wrapped, "no_sync") else self.wrapped.no_sync()
            with sync, self.precision.matmuls(self.device):
                with self.precision.autocast(self.device):
                    out = self.wrapped(**batch, return_logits=False)
                loss = out.loss / run.grad_accum
                # the logged loss stays the language model's; the supervised retrieval is logged beside it
                optimised = loss
                if out.retrieval_loss is not None:
                    optimised = loss + self.retrieval_weight * out.retrieval_loss / run.grad_accum
                    retrieval += _retrieval_sums(out)
                (optimised if self.scaler is None else self.scaler.scale(optimised)).backward()
            total += loss.detach()
        if self.retrieval_weight:
            loss_sum, found, counted = dist_utils.all_reduce_sum(retrieval, self.ctx).tolist()
            self._step_retrieval = {"retrieval_loss": loss_sum / (self.ctx.world_size * run.grad_accum)}
            if counted:
                self._step_retrieval["retrieval_found"] = found / counted
        return total, tokens

    def _train_step(self) -> tuple[float, float, int]:
        """One optimizer step over grad_accum micro-batches: (loss, gradient norm, tokens of all
        ranks); the tokens with a label, of all ranks, in `self._step_real_tokens`."""
        total, tokens = self._gradients()
        tokens, self._step_real_tokens = self._all_ranks(tokens, self._step_real_tokens)
        loss_value = float(dist_utils.all_reduce_mean(total, self.ctx))
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.config.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf")))
        overflow_skips = self.scaler is not None and self.scaler.get_scale() >= MIN_LOSS_SCALE
        if not (math.isfinite(loss_value) and (math.isfinite(grad_norm) or overflow_skips)):
            latest = self.latest_checkpoint()
            what = "loss" if not math.isfinite(loss_value) else "gradient norm"
            fix = "Lower optim.lr, set optim.grad_clip, or check the data for bad tokens"
            if self.scaler is not None:
                fix += f" (the fp16 loss scale is down to {self.scaler.get_scale():g}; bf16-mixed has fp32's range)"
            raise TrainingDiverged(
                f"{what} is {loss_value if what == 'loss' else grad_norm} at step {self.step + 1}; stopped without "
                f"updating the weights. Last good checkpoint: {latest or 'none saved yet'}. {fix}."
            )
        if grad_norm == 0.0 and loss_value != 0.0:
            cause = (
                "the compiled model lost its autograd graph; set train.compile=false"
                if self.compiled is not None
                else "check that the model's parameters require grad and the loss depends on them"
            )
            raise GradientLost(
                f"no parameter received a gradient at step {self.step + 1} (loss {loss_value:.4g}, gradient "
                f"norm 0); stopped without updating the weights: {cause}"
            )
        if self.scaler is None:
            self.optimizer.step()
            self.scheduler.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when the gradients overflowed
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                self.skipped_steps += 1
            else:
                self.scheduler.step()
        self.step += 1
        return loss_value, grad_norm, tokens

    def _all_ranks(self, *counts: int) -> tuple[int, ...]:
        """Counts summed over the ranks (ranks of supervised examples see batches of other widths)."""
        if not self.ctx.enabled:
            return counts
        summed = dist_utils.all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=self.device), self.ctx)
        return tuple(int(round(float(n))) for n in summed)

    def _trim_metrics(self, path: Path) -> None:
        """Drop the records after the resumed step (logged before a crash, about to be redone)
        and a last line that a crash cut short."""
        if not path.exists():
            return
        kept = [
            record
            for record in read_metrics(path)
            if isinstance(record.get("step"), int) and record["step"] <= self.step
        ]
        write_text_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))

    def fit(
        self, resume: bool = True, allow_config_change: bool = False, allow_data_change: bool = False
    ) -> TrainResult:
        """Train to train.steps, resuming the run in train.out_dir unless not `resume`. The run
        directory has one owner: the main process holds its lock (`farsight.files.folder_lock`)
        for the whole run, so a second process training into it meanwhile is refused in one line
        naming the first (a lock left by a process that died is taken over), and an out_dir
        holding anything but a run (a model, a dataset, other files) is refused."""
        if not self.ctx.is_main:
            return self._fit(resume, allow_config_change, allow_data_change)
        run = self.config.train
        try:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)  # where the lock file goes
        except OSError as exc:
            raise ConfigError(
                f"cannot create train.out_dir={run.out_dir} ({exc.strerror}); set train.out_dir to a directory you can write"
            ) from exc
        with folder_lock(self.out_dir, "farsight train", "set train.out_dir to another folder"):
            claim_output_folder(
                self.out_dir,
                "run",
                name=f"train.out_dir={run.out_dir}",
                fix="set train.out_dir to a new folder (or to a run's, to resume it)",
            )
            return self._fit(resume, allow_config_change, allow_data_change)

    def _fit(self, resume: bool, allow_config_change: bool, allow_data_change: bool) -> TrainResult:
        run = self.config.train
        if self.ctx.is_main:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create train.out_dir={run.out_dir} ({exc.strerror}); set train.out_dir to a directory you can write"
                ) from exc
        if not resume and self._deferred_init:
            # before the old checkpoints go, so a bad source leaves them; the parameters are the
            # wrapped model's (DDP shares them) and load_weights casts to their precision
            if self._sharded:
                raise ConfigError(
                    f"--restart of an FSDP run with train.init_from: delete {self.ckpt_root} and train again"
                )
            self._init_weights(self._deferred_init)
        if not resume and self.ctx.is_main and self.ckpt_root.is_dir():
            # starting over: older checkpoints would otherwise look newer than the new run's
            logger.info(f"starting over: removing the checkpoints in {self.ckpt_root}")
            kept = remove_checkpoints(self.ckpt_root)
            if kept:
                listed = ", ".join(kept[:5]) + (", ..." if len(kept) > 5 else "")
                logger.info(
                    f"note: kept {len(kept)} file{'s' if len(kept) != 1 else ''} farsight did not write in {self.ckpt_root}: {listed}"
                )
        dist_utils.barrier(self.ctx)
        found = list_checkpoints(self.ckpt_root) if resume else []
        if found and found[-1][0] >= run.steps:
            self._check_finished_model(found[-1][1])
            # a finished run, or one continued past its config's steps (--set train.steps=N): leave it and its
            # config.yaml as they are; its trainer state is not read, so a shipped run may leave it out
            if self.ctx.is_main:
                past = f", past train.steps={run.steps}" if found[-1][0] > run.steps else ""
                logger.info(f"{self.out_dir} is at step {found[-1][0]}{past}: nothing to train")
            return TrainResult(status="completed", step=found[-1][0], checkpoint=found[-1][1])
        resumed = resume and self.resume(allow_config_change, allow_data_change)
        if self.ctx.is_main:
            dump_train_config(self.config, self.out_dir / "config.yaml")
            if resumed:
                self._trim_metrics(self.out_dir / "metrics.jsonl")
                logger.info(f"resumed from step {self.step} ({self.latest_checkpoint()})")
            how = " (train.precision=auto)" if run.precision == "auto" else ""
            logger.info(f"training in {self.precision.name}{how} on {self.device}")
            note = precision_note(self.precision, self.device)
            if note:
                logger.warning(note)
            warmup = self.config.optim.warmup_steps
            if warmup >= run.steps:
                logger.warning(
                    f"note: optim.warmup_steps={warmup} is not below train.steps={run.steps}: the learning rate rises "
                    f"for the whole run and never reaches optim.lr={self.config.optim.lr:g}; lower optim.warmup_steps"
                )
            if self.compiled is not None:
                how = " (train.compile=auto)" if run.compile == "auto" else ""
                logger.info(
                    f"compiling the model's blocks and loss with torch.compile{how}: the first step takes longer"
                )
            elif self.compile_note and self.device.type == "cpu" and run.steps >= AUTO_MIN_STEPS:
                logger.info(f"not compiling (train.compile=auto): {self.compile_note}")
        # a fresh run starts a fresh log; a resumed one continues it
        metrics = open(self.out_dir / "metrics.jsonl", "a" if resumed else "w") if self.ctx.is_main else None
        writer = self._tensorboard() if run.tensorboard and self.ctx.is_main else None
        bar = progress_bar(
            total=run.steps,
            initial=self.step,
            unit="step",
            disable=not (run.progress and self.ctx.is_main),
            dynamic_ncols=True,
        )
        losses: list[tuple[int, float]] = []
        status, checkpoint, saved_step = "completed", None, -1
        self.wrapped.train()
        compile_logged = 0.0
        try:
            with _StopRequest() as stop, flush_denormals(self.device), self.compile_clock:
                t_last, tokens_last, real_last = time.perf_counter(), 0, 0
                while self.step < run.steps:
                    first_compiled = self.compiled is not None and not self._compile_checked
                    loss, grad_norm, tokens = self._train_step()
                    if first_compiled and self.compiled is not None and self.ctx.is_main:
                        logger.info(f"compiled in {self.compile_clock.seconds:.1f}s")
                    self.tokens_seen += tokens
                    tokens_last += tokens
                    real_last += self._step_real_tokens
                    if self.real_tokens_seen is not None:
                        self.real_tokens_seen += self._step_real_tokens
                    losses.append((self.step, loss))
                    if self.step % run.log_interval == 0 or self.step == run.steps:
                        release_freed_memory()
                        elapsed = time.perf_counter() - t_last
                        rate = tokens_last / max(elapsed, 1e-9)
                        record = {
                            "step": self.step,
                            "loss": loss,
                            "lr": self.scheduler.get_last_lr()[0],
                            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,  # None: a skipped fp16 step
                            "tokens": self.tokens_seen,
                            "tokens_per_s": rate,
                            # the tokens with a label: the padding of supervised examples left out
                            "real_tokens_per_s": real_last / max(elapsed, 1e-9),
                            "rss_mb": current_rss_bytes() / 2**20,
                            "precision": self.precision.name,
                            "device": self.device_name,
                        }
                        if self.real_tokens_seen is not None:
                            record["real_tokens"] = self.real_tokens_seen
                        record |= self._step_retrieval
                        if self.scaler is not None:
                            record |= {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped_steps}
                        if self.compile_clock.seconds > compile_logged:  # compiling, within this interval
                            record["compile_s"] = self.compile_clock.seconds - compile_logged
                            compile_logged = self.compile_clock.seconds
                        self._log(metrics, writer, record)
                        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
                        t_last, tokens_last, real_last = time.perf_counter(), 0, 0
                    bar.update(1)
                    if self.step % run.eval_interval == 0 or self.step == run.steps:
                        val = self.evaluate()
                        if val is not None:
                            self._log(metrics, writer, {"step": self.step, **val})
                    if self.step % run.checkpoint_interval == 0 or self.step == run.steps:
                        checkpoint, saved_step = self.save(), self.step
                    if dist_utils.any_rank(stop.requested, self.ctx, self.device):
                        status = "interrupted"
                        if saved_step != self.step:
                            checkpoint = self.save()
                        break
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
            if writer is not None:
                writer.close()
        if status == "interrupted" and self.ctx.is_main:
            logger.warning(
                f"interrupted at step {self.step}; checkpoint saved to {checkpoint}. Run the same command to resume."
            )
        return TrainResult(
            status=status, step=self.step, checkpoint=checkpoint or self.latest_checkpoint(), losses=losses
        )

    def _log(self, metrics: Any, writer: Any, record: dict[str, Any]) -> None:
        if metrics is None:
            return
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        if writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, record["step"])

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingDependencyError(
                "train.tensorboard=true needs TensorBoard: pip install farsight[tensorboard]"
            ) from exc
        return SummaryWriter(str(self.out_dir / "tensorboard"))

    def close(self) -> None:
        dist_utils.shutdown(self.ctx)


def train(
    config: TrainConfig, resume: bool = True, allow_config_change: bool = False, allow_data_change: bool = False
) -> TrainResult:
    trainer = Trainer(config)
    try:
        return trainer.fit(resume=resume, allow_config_change=allow_config_change, allow_data_change=allow_data_change)
    finally:
        trainer.close()
