"""Every shipped training config loads, builds its model, validates its data section and writes
its run to runs/ + its path under configs/; a fine-tune's init_from names the out_dir of another
shipped config with the same model; every config path the Makefile and experiment scripts name
exists."""

import re
from collections import Counter
from pathlib import Path

import pytest

from farsight.data.batches import DATA_KINDS
from farsight.models import build_model
from farsight.train.config import load_train_config

REPO = Path(__file__).parents[1]
CONFIG_ROOT = REPO / "configs"
CONFIGS = sorted(CONFIG_ROOT.rglob("*.yaml"))


def name(path: Path) -> str:
    """A config's name: its path under configs/ without .yaml, e.g. lm/passkey/drt-x2."""
    return path.relative_to(CONFIG_ROOT).with_suffix("").as_posix()


def test_configs_are_found():
    assert len(CONFIGS) >= 60
    assert not list(CONFIG_ROOT.glob("*.yaml")), "configs live in folders by experiment (configs/README.md)"


def test_folders_hold_at_most_15_configs():
    counts = Counter(path.parent for path in CONFIGS)
    crowded = {str(folder.relative_to(REPO)): n for folder, n in counts.items() if n > 15}
    assert not crowded


@pytest.mark.parametrize("path", CONFIGS, ids=name)
def test_config_loads_builds_and_validates(path):
    config = load_train_config(path)
    build_model(config.model)
    data = dict(config.data)
    config_class, _ = DATA_KINDS[data.pop("kind", "tokens")]
    config_class.from_dict(data, where="data")


@pytest.mark.parametrize("path", CONFIGS, ids=name)
def test_out_dir_is_runs_plus_the_config_path(path):
    assert load_train_config(path).train.out_dir == f"runs/{name(path)}"


READING = ("top_k", "neighbors_before", "neighbors_after")


def test_fine_tunes_start_from_a_shipped_run_with_the_same_model():
    configs = {name(p): load_train_config(p) for p in CONFIGS}
    by_out_dir = {c.train.out_dir: (key, c) for key, c in configs.items()}
    fine_tunes = {key: c for key, c in configs.items() if c.train.init_from and c.train.init_from.startswith("runs/")}
    assert len(fine_tunes) >= 40
    for key, config in fine_tunes.items():
        assert config.train.init_from in by_out_dir, f"{key}: no config writes {config.train.init_from}"
        source_name, source = by_out_dir[config.train.init_from]
        assert source_name != key, f"{key} starts from its own run"
        # how many chunks are read (retrieved, and beside each) may change between stages: it shapes no weight
        same = {name: value for name, value in config.model.items() if name not in READING}
        assert same == {name: value for name, value in source.model.items() if name not in READING}, (
            f"{key}'s model differs from {source_name}'s"
        )


def test_config_paths_named_by_the_makefile_and_scripts_exist():
    # literal paths only: one built from a shell variable (configs/lm/pretrain/$model.yaml) or a
    # placeholder in a comment (configs/castle/<kind>.yaml) is left out
    scripts = [REPO / "Makefile", *sorted((REPO / "experiments").rglob("*.sh"))]
    named = {
        (script.name, match)
        for script in scripts
        for match in re.findall(r"configs/[^\s\"'$<>]*\.yaml", script.read_text())
    }
    assert len(named) >= 5
    missing = sorted(f"{script}: {path}" for script, path in named if not (REPO / path).is_file())
    assert not missing
