import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from farsight.cli import main
from farsight.errors import InputError, MissingFileError
from farsight.eval.card import model_card, training_chain
from farsight.models import DRTConfig, DRTForCausalLM, load_model

CONFIG = {"type": "drt", "vocab_size": 260, "d_model": 32, "n_layers": 4, "n_heads": 2, "chunk_size": 8, "window": 16, "top_k": 2, "groups": 1, "encoder_layers": 1}


def make_run(root, data, steps, init_from=None, model=None):
    """A finished training run: config.yaml, metrics.jsonl and one checkpoint."""
    model = model or DRTForCausalLM(DRTConfig(**{k: v for k, v in CONFIG.items() if k != "type"}))
    model.save_pretrained(root / "checkpoints" / f"step_{steps:08d}")
    config = {"model": CONFIG, "data": data, "optim": {"lr": 0.001}, "train": {"steps": steps, "out_dir": str(root), "init_from": init_from}}
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    records = [{"step": steps, "loss": 1.5, "tokens": steps * 100, "tokens_per_s": 1000.0, "precision": "bf16-mixed"}, {"step": steps, "val_loss": 1.25}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture
def two_stages(tmp_path):
    lm = make_run(tmp_path / "lm", {"kind": "tokens", "path": "data/lm-byte", "seq_len": 4096}, 40)
    needle = {"kind": "needle", "mix": {"passkey": 2, "multikey": 1}, "corpus": "data/lm-byte", "curriculum": [[0, 128], [10, 1024]], "answer_weight": 10, "align": 1}
    return make_run(tmp_path / "ft", needle, 20, init_from=str(lm / "checkpoints" / "step_00000040"))


def test_the_chain_follows_init_from_back_to_the_first_run(two_stages, tmp_path):
    assert training_chain(two_stages) == [tmp_path / "lm", tmp_path / "ft"]
    with pytest.raises(MissingFileError, match="not a training run"):
        training_chain(tmp_path / "nothing")


def test_the_card_lists_every_stage_and_the_results(two_stages, tmp_path):
    needle = {"task": "passkey", "corpus": "data/lm-byte", "split": "val", "dtype": "bf16", "align": 1,
              "by_length": {"1024": {"trials": 50, "exact_match": 0.98, "exact_match_ci95": [0.9, 1.0], "needle_retrieved": 1.0}}}
    ppl = {"corpus": "data/lm-byte", "split": "val", "dtype": "bf16", "results": {
        str(tmp_path / "lm"): {"by_length": {"4096": {"nll": 1.2, "nll_sem": 0.01, "windows": 12}}},
        "runs/other": {"by_length": {"4096": {"nll": 9.0, "nll_sem": 0.01, "windows": 12}}}}}
    (tmp_path / "n.json").write_text(json.dumps(needle))
    (tmp_path / "p.json").write_text(json.dumps(ppl))
    card = model_card(two_stages, "my-drt", [tmp_path / "n.json", tmp_path / "p.json"])
    assert "trained on 6,000 tokens in 2 stages" in card  # 40 x 100 + 20 x 100
    assert "language modelling on `data/lm-byte`, 4K-token windows" in card
    assert "needle tasks (passkey 2, multikey 1)" in card and "lengths 128 → 1K" in card
    assert "| 1K | 50 | 98 | 90-100 | 100 |" in card
    assert "| 4K | 12 | 1.2000 | 0.0100 |" in card and "9.0000" not in card  # only this model's perplexity
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(InputError, match="neither a needle summary nor a perplexity file"):
        model_card(two_stages, "my-drt", [tmp_path / "bad.json"])


def test_export_casts_the_weights_and_writes_the_card(two_stages, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(two_stages), str(out), "--dtype", "bf16", "--card"]) == 0
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values() if t.is_floating_point())
    model = load_model(out)  # verified against checksums.json, loaded into the fp32 model
    source = load_file(two_stages / "checkpoints" / "step_00000020" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in source:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, source[name].to(torch.bfloat16).float()), name
    assert (out / "README.md").read_text().startswith("# exported\n")
    assert main(["export", str(two_stages), str(tmp_path / "x"), "--results", "r.json"]) == 2
