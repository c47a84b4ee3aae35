"""Configs and whole models, caches and inference sessions."""

from farsight.models.lm import CausalLMOutput, PretrainedLM, causal_lm_loss, load_model, sample_next_token
from farsight.models.transformer import TransformerConfig, TransformerForCausalLM

__all__ = [
    "CausalLMOutput",
    "PretrainedLM",
    "TransformerConfig",
    "TransformerForCausalLM",
    "causal_lm_loss",
    "load_model",
    "sample_next_token",
]
