"""Every shipped training config loads, builds its model, validates its data section, and a
fine-tune's init_from names the out_dir of another shipped config with the same model."""

from pathlib import Path

import pytest

from farsight.data.batches import DATA_KINDS
from farsight.models import build_model
from farsight.train.config import load_train_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_are_found():
    assert len(CONFIGS) >= 20


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_builds_and_validates(path):
    config = load_train_config(path)
    build_model(config.model)
    data = dict(config.data)
    config_class, _ = DATA_KINDS[data.pop("kind", "tokens")]
    config_class.from_dict(data, where="data")


def test_fine_tunes_start_from_a_shipped_run_with_the_same_model():
    configs = {p.stem: load_train_config(p) for p in CONFIGS}
    by_out_dir = {c.train.out_dir: (name, c) for name, c in configs.items()}
    fine_tunes = {name: c for name, c in configs.items() if c.train.init_from and c.train.init_from.startswith("runs/")}
    assert len(fine_tunes) >= 10
    for name, config in fine_tunes.items():
        assert config.train.init_from in by_out_dir, f"{name}: no config writes {config.train.init_from}"
        source_name, source = by_out_dir[config.train.init_from]
        assert source.model == config.model, f"{name}'s model differs from {source_name}'s"
