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
