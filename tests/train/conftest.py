import pytest

from farsight.data.token_files import prepare_corpus
from farsight.data.tokenizers import load_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"doc{i:02d}.txt").write_text(f"document {i}: " + TEXT)
    out = root / "tokens"
    prepare_corpus([str(docs)], load_tokenizer("byte"), out, val_fraction=0.2, seed=0, progress=False)
    return out


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory):
    """Supervised examples (data.kind: sft) of 24 to about 100 byte tokens, prompt/completion and chat records."""
    import json

    from farsight.data.sft import prepare_sft

    root = tmp_path_factory.mktemp("sft")
    records = []
    for i in range(30):
        words = " ".join(["fox", "dog", "jumps", "lazy"][(i + j) % 4] for j in range(3 + i % 17))
        if i % 3:
            records.append({"prompt": f"{words}. Count {i}:", "completion": f" {i % 7}"})
        else:
            messages = [{"role": "user", "content": words}, {"role": "assistant", "content": f"{i % 5} words"}]
            records.append({"messages": messages})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "tokens"
    prepare_sft([root / "train.jsonl"], load_tokenizer("byte"), out, val_fraction=0.2, progress=False)
    return out


def tiny_config(token_dir, out_dir, **train):
    from farsight.train.config import TrainConfig

    raw = {
        "model": {"type": "transformer", "d_model": 32, "n_layers": 2, "n_heads": 2},
        "data": {"path": str(token_dir), "seq_len": 32, "batch_size": 4},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {
            "steps": 6,
            "out_dir": str(out_dir),
            "log_interval": 1,
            "eval_interval": 1000,
            "eval_batches": 1,
            "checkpoint_interval": 1000,
            "progress": False,
            "precision": "fp32",  # the same arithmetic on every machine ("auto" depends on the CPU)
            **train,
        },
    }
    return TrainConfig.from_dict(raw)


def tiny_sft_config(sft_dir, out_dir, **train):
    """tiny_config on supervised examples (data.kind: sft)."""
    from farsight.train.config import TrainConfig

    raw = tiny_config(sft_dir, out_dir, **train).to_dict()
    raw["data"] = {"kind": "sft", "path": str(sft_dir), "seq_len": 128, "batch_tokens": 256}
    return TrainConfig.from_dict(raw)
