"""farsight: attention that sees past its window — causal retrieval (GCA/DRT) and lookahead keys (CASTLE).

    from farsight import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM, load_model
    from farsight.ops import gca, castle_attention, sliding_window_attention

The model names below are imported on first use, so `import farsight.ops` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "DRTConfig": "farsight.models",
    "DRTForCausalLM": "farsight.models",
    "TransformerConfig": "farsight.models",
    "TransformerForCausalLM": "farsight.models",
    "load_model": "farsight.models",
    "build_model": "farsight.models",
    "FarsightError": "farsight.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farsight' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
