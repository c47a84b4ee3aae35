"""`train.compile`: torch.compile (inductor) for a model's blocks and its loss head.

What is compiled: the forward of every transformer block (`farsight.layers.TransformerBlock`,
DRT's retrieval blocks and chunk-encoder blocks included) and the model's `logits_and_loss`
(final norm, LM head, cross-entropy). Inductor fuses what lies between the matrix products: the
RMSNorms, SwiGLU, RoPE, the residual adds, the autocast casts and the loss's log-softmax, in the
forward and the backward. The attention kernels (sliding window, CASTLE, GCA, SDPA) are custom
ops or ATen kernels, opaque to the compiler, and run as they do eagerly. Everything else (the
embedding, the input checks, DRT's retrieval, top-k and chunk memory, the optimizer) stays eager,
so nothing data-dependent reaches a compiled region and no graph breaks.

The compiled callables are instance attributes (`block.forward`, `model.logits_and_loss`), so
the module tree and its state_dict are those of the plain model: checkpoints hold the usual
names, and `eager(model)` runs a compiled model eagerly for a while (the trainer's evaluation).

Compilation happens on first use and takes tens of seconds on a 2-core CPU (once per block kind,
shape and grad mode: the eight blocks of a model share one compiled graph); `CompileClock`
measures it through torch's compile callbacks.

Measured on a 2-core AMX Xeon (docs/training.md): CPU training steps ran faster compiled;
`resolve_compile` turns "auto" into on for CPU runs long enough to amortise the compilation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# train.compile=auto compiles CPU runs of at least this many steps: compiling a d_model-256
# model's blocks and loss took 40-90 s on a 2-core CPU, which steps 1.3-1.9x faster win back
# within about a hundred steps of 16K tokens.
AUTO_MIN_STEPS = 100
# Shapes (a curriculum's lengths, the last partial batch) each compiled function may take
# before torch falls back to eager for the new ones.
RECOMPILE_LIMIT = 32


def resolve_compile(
    setting: Any, device: torch.device, steps: int, sharded: bool, widened: bool, varying_shapes: bool = False
) -> tuple[bool, str | None]:
    """(compile or not, why not when "auto" says no) for `train.compile=setting`.

    auto: on for CPU training of at least AUTO_MIN_STEPS steps, except under FSDP, where the
    precision's products are widened to fp32 GEMMs (a dispatch mode torch.compile does not
    trace) and where batch widths vary from step to step (supervised examples padded to the
    longest of their batch: every new width recompiled for about 30 s); off on GPUs (not measured there: the GCA and CASTLE Triton kernels are launched
    eagerly) and other devices.
    """
    if setting is True or setting is False:
        return setting, None
    if device.type != "cpu":
        return False, f"not on {device.type}"
    if sharded:
        return False, "FSDP runs are not compiled"
    if widened:
        return False, "this CPU runs the precision's products as fp32 GEMMs, which torch.compile does not trace"
    if varying_shapes:
        return False, "batch shapes vary from step to step, and each new shape would recompile"
    if steps < AUTO_MIN_STEPS:
        return False, f"runs of fewer than {AUTO_MIN_STEPS} steps do not amortise the compilation"
    return True, None


def _targets(model: nn.Module) -> list[nn.Module]:
    from farsight.layers import TransformerBlock

    return [module for module in model.modules() if isinstance(module, TransformerBlock)]


@dataclass
class CompiledModel:
    """What `compile_model` compiled: {module: its eager forward}, and the loss head."""

    model: nn.Module
    blocks: dict[nn.Module, Any] = field(default_factory=dict)
    loss: Any = None

    @property
    def active(self) -> bool:
        return "logits_and_loss" in vars(self.model)

    def _set(self, compiled: bool) -> None:
        for block, forward in self.blocks.items():
            if compiled:
                block.forward = forward
            else:
                vars(block).pop("forward", None)
        if compiled:
            self.model.logits_and_loss = self.loss
        else:
            vars(self.model).pop("logits_and_loss", None)

    def remove(self) -> None:
        """Back to the eager modules for good."""
        self._set(False)
        self.blocks.clear()


def compile_model(model: nn.Module) -> CompiledModel:
    """Compile `model`'s blocks and `logits_and_loss` in place (on first call; see the module doc).
    A model compiled already is compiled anew from its eager modules."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
    for block in _targets(model):
        vars(block).pop("forward", None)
    vars(model).pop("logits_and_loss", None)
    compiled = CompiledModel(model)
    for block in _targets(model):
        compiled.blocks[block] = torch.compile(block.forward)
    compiled.loss = torch.compile(model.logits_and_loss)
    compiled._set(True)
    return compiled


@contextlib.contextmanager
def eager(compiled: CompiledModel | None) -> Iterator[None]:
    """Run the modules of `compiled` eagerly inside the block (nothing to do for None)."""
    if compiled is None or not compiled.active:
        yield
        return
    compiled._set(False)
    try:
        yield
    finally:
        compiled._set(True)


class CompileClock:
    """Seconds torch spent compiling while the clock was installed (torch.compile's start/end
    callbacks: dynamo's traces and the lazily compiled backward graphs)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.compilations = 0
        self._started: float | None = None
        self._handler = None

    def _start(self, args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, args: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compilations += 1
            self._started = None

    def __enter__(self) -> CompileClock:
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without the callbacks: the clock reads 0
            return self
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handler is not None:
            self._handler.remove_start_callback(self._start)
            self._handler.remove_end_callback(self._end)
            self._handler = None


def failure_note(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if len(what) > 300:
        what = what[:297] + "..."
    return f"note: torch.compile failed ({what}); training eagerly (set train.compile=false to skip compiling)"
