import json

import pytest
import torch

from farsight.config import ConfigError
from farsight.models import TransformerConfig, TransformerForCausalLM, build_model, load_model, sample_next_token

KINDS = [("causal", {}), ("sliding", {"window": 6})]


def tiny(kind="causal", **kw):
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, attention=kind, **kw)
    return TransformerForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind,extra", KINDS)
def test_forward_shapes_and_loss(kind, extra):
    model = tiny(kind, **extra)
    ids = torch.randint(0, 40, (3, 17))
    out = model(ids, labels=ids)
    assert out.logits.shape == (3, 17, 40)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, manual)


def test_loss_weights_and_ignored_labels():
    model = tiny()
    ids = torch.randint(0, 40, (2, 9))
    labels = ids.clone()
    labels[:, :5] = -100
    weights = torch.ones(2, 9)
    weights[:, -1] = 10.0
    out = model(ids, labels=labels, loss_weights=weights)
    ce = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1), reduction="none"
    ).view(2, 8)
    w = weights[:, 1:] * (labels[:, 1:] != -100)
    torch.testing.assert_close(out.loss, (ce * w).sum() / w.sum())


@pytest.mark.parametrize("kind,extra", KINDS)
def test_greedy_generate_equals_argmax_of_full_forward(kind, extra):
    model = tiny(kind, **extra)
    prompt = torch.randint(0, 40, (2, 5))
    out = model.generate(prompt, 12, temperature=0)
    assert out.shape == (2, 17)
    logits = model(out).logits
    assert torch.equal(logits[:, 4:-1].argmax(-1), out[:, 5:])


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    assert all(sample_next_token(logits, 1.0, top_k=1, generator=g).item() == 3 for _ in range(5))
    drawn = {sample_next_token(logits, 1.0, top_p=0.7, generator=g).item() for _ in range(50)}
    assert drawn <= {2, 3} and 3 in drawn
    assert sample_next_token(logits, 0).item() == 3
    with pytest.raises(ValueError, match="top_p"):
        sample_next_token(logits, 1.0, top_p=0)


def test_generate_stops_at_eos():
    model = tiny()
    prompt = torch.randint(0, 40, (1, 4))
    first = model.generate(prompt, 1, temperature=0)[0, -1].item()
    out = model.generate(prompt, 10, temperature=0, eos_token_id=first)
    assert out.shape[1] == 5


@pytest.mark.parametrize("kind,extra", KINDS)
def test_save_load_round_trip(tmp_path, kind, extra):
    model = tiny(kind, **extra)
    model.save_pretrained(tmp_path / "m")
    again = load_model(tmp_path / "m")
    assert isinstance(again, TransformerForCausalLM) and again.config == model.config
    ids = torch.randint(0, 40, (1, 11))
    torch.testing.assert_close(again.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert again.lm_head.weight is again.embed.weight


def test_truncated_or_foreign_checkpoints_fail_clearly(tmp_path):
    model = tiny()
    path = model.save_pretrained(tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_model(path)
    meta = json.loads((path / "config.json").read_text())
    meta["model_type"] = "drt"
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises((ValueError, ConfigError), match="drt"):
        TransformerForCausalLM.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(d_model=30, n_heads=4), "does not divide"),
        (dict(attention="sliding"), "window must be an integer >= 1"),
        (dict(attention="sliding", window=0), "window must be an integer >= 1"),
        (dict(window=8), "not used by attention='causal'"),
        (dict(attention="nope"), "unknown"),
        (dict(attention="causal", position="alibi"), "not supported"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TransformerConfig(vocab_size=40, **kwargs)


def test_unknown_config_key_suggests_the_field():
    with pytest.raises(ConfigError, match="did you mean 'model.n_heads'"):
        build_model({"type": "transformer", "n_head": 4})


def test_vocab_mismatch_with_tokenizer():
    class Tok:
        vocab_size = 300

    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        build_model({"type": "transformer", "vocab_size": 260}, Tok())


def test_out_of_vocabulary_ids():
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        tiny()(torch.tensor([[1, 2, 40]]))
