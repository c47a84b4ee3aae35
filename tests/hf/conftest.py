"""Shared fixtures of the Hugging Face / lm-eval integration tests: offline hubs, the shipped demo
DRT, and a tiny CASTLE transformer saved with its byte tokenizer."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from farsight.data.tokenizers import ByteTokenizer  # noqa: E402
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM  # noqa: E402

DEMO_DRT = Path(__file__).resolve().parents[2] / "models" / "demo-drt"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def drt_dir() -> Path:
    return DEMO_DRT


@pytest.fixture(scope="session")
def castle_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, attention="castle")
    return TransformerForCausalLM(config).save_pretrained(
        tmp_path_factory.mktemp("castle") / "model", tokenizer=ByteTokenizer()
    )


@pytest.fixture(scope="session")
def tiny_drt_dir(tmp_path_factory) -> Path:
    """A DRT small enough for many decoding steps in a test (the demo's steps take ~0.2 s here)."""
    torch.manual_seed(0)
    config = DRTConfig(
        vocab_size=260,
        d_model=32,
        n_layers=2,
        n_heads=2,
        chunk_size=8,
        window=16,
        top_k=2,
        encoder_layers=1,
        landmark_id=259,
        pad_id=256,
    )
    return DRTForCausalLM(config).save_pretrained(tmp_path_factory.mktemp("drt") / "model", tokenizer=ByteTokenizer())


@pytest.fixture(scope="session", params=["demo-drt", "castle"])
def model_dir(request, drt_dir, castle_dir) -> Path:
    return drt_dir if request.param == "demo-drt" else castle_dir
