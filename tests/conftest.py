import logging
import os

import pytest
import torch

# Without a GPU, farsight's Triton kernels are tested under Triton's interpreter. The variable must
# be set before triton is first imported, and transformers (tests/hf) imports it through torch's
# own Triton ops, so it is set here for the whole session rather than by the kernel test modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _library_output():
    """Each test starts with farsight's output as a fresh process has it: `farsight.cli.main`
    attaches a terminal handler, sets the `farsight` logger's level, stops its records from
    reaching the root logger (which caplog reads) and may turn the progress bars off; all of it
    is put back after the test."""
    from farsight.progress import show_progress_bars

    logger = logging.getLogger("farsight")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
    show_progress_bars(True)


@pytest.fixture
def widened_ops(monkeypatch):
    """The names of the aten ops that farsight.ops.precision.WidenedMatmuls computed in fp32, in
    call order (a spy on its one call path)."""
    from farsight.ops import precision

    calls = []
    original = precision._widened_call

    def spy(func, dtype, args, kwargs):
        calls.append(func.__name__.split(".")[0])
        return original(func, dtype, args, kwargs)

    monkeypatch.setattr(precision, "_widened_call", spy)
    return calls


@pytest.fixture
def farsight_log(caplog):
    """What farsight logged at INFO and above while the test ran (`.text`, `.records`); the library
    logs through `logging` and leaves the terminal to the `farsight` command."""
    caplog.set_level(logging.INFO, logger="farsight")
    return caplog
