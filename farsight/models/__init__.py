"""Configs and whole models, their inference sessions, caches and model directories."""

from farsight.models.causal_retrieval import parse_neighbors, set_retrieval_neighbors, set_retrieval_top_k
from farsight.models.chunk_memory import KV_DTYPES, MEMORY_TIERS
from farsight.models.drt import DRTConfig, DRTForCausalLM
from farsight.models.drt_session import DRTSession
from farsight.models.drt_state import RetrievalInfo
from farsight.models.generation import generate, sample_next_token
from farsight.models.io import CONFIG_FILE, WEIGHTS_FILE, load_weights, read_model_meta, resolve_model_dir
from farsight.models.lm import MODEL_DTYPES, CausalLMOutput, PretrainedLM, causal_lm_loss
from farsight.models.registry import MODEL_TYPES, build_model, export_model, load_model
from farsight.models.session import ContinuationScore, Session
from farsight.models.transformer import TransformerConfig, TransformerForCausalLM, TransformerSession

__all__ = [
    "CONFIG_FILE",
    "KV_DTYPES",
    "MEMORY_TIERS",
    "MODEL_DTYPES",
    "MODEL_TYPES",
    "WEIGHTS_FILE",
    "CausalLMOutput",
    "DRTConfig",
    "DRTForCausalLM",
    "ContinuationScore",
    "DRTSession",
    "PretrainedLM",
    "RetrievalInfo",
    "Session",
    "TransformerConfig",
    "TransformerForCausalLM",
    "TransformerSession",
    "build_model",
    "export_model",
    "causal_lm_loss",
    "generate",
    "load_model",
    "load_weights",
    "read_model_meta",
    "resolve_model_dir",
    "sample_next_token",
    "parse_neighbors",
    "set_retrieval_neighbors",
    "set_retrieval_top_k",
]
