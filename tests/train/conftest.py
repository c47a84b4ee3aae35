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
