"""Configs and whole models, caches and inference sessions."""

from farsight.models.drt import DRTConfig, DRTForCausalLM, RetrievalInfo
from farsight.models.lm import CausalLMOutput, PretrainedLM, causal_lm_loss, load_model, sample_next_token
from farsight.models.transformer import TransformerConfig, TransformerForCausalLM

__all__ = [
    "CausalLMOutput",
    "DRTConfig",
    "DRTForCausalLM",
    "PretrainedLM",
    "RetrievalInfo",
    "TransformerConfig",
    "TransformerForCausalLM",
    "causal_lm_loss",
    "load_model",
    "sample_next_token",
]
