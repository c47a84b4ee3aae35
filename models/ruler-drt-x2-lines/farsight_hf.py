"""A farsight model directory: transformers imports this file for trust_remote_code=True, and it
only imports the classes of the installed farsight package (the directory holds no model code)."""

try:
    from farsight.hf import (
        FarsightDRTConfig,
        FarsightDRTForCausalLM,
        FarsightTokenizerFast,
        FarsightTransformerConfig,
        FarsightTransformerForCausalLM,
    )
except ImportError as exc:
    raise ImportError(f"this model needs the farsight package: pip install 'farsight[hf]' ({exc})") from None

__all__ = [
    "FarsightDRTConfig",
    "FarsightDRTForCausalLM",
    "FarsightTokenizerFast",
    "FarsightTransformerConfig",
    "FarsightTransformerForCausalLM",
]
