"""Config files that say one thing and would do another: a section left empty (its fields
commented out) keeps the base's values, an explicit null resets, and a file or section that is
not a mapping is refused in one line, with or without --set."""

import logging

import pytest

from farsight.cli import main
from farsight.config import ConfigError
from farsight.data.tasks.training import NeedleBatchConfig
from farsight.train.config import apply_overrides, load_train_config

BASE = (
    "model: {type: transformer, d_model: 32}\n"
    "data: {path: d, seq_len: 64}\n"
    "optim: {lr: 0.01}\n"
    "train: {steps: 5, out_dir: runs/a, log_interval: 1}\n"
)


@pytest.fixture
def base(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    return tmp_path / "base.yaml"


def test_an_empty_section_keeps_the_base_values_and_takes_overrides(base):
    child = base.with_name("child.yaml")
    child.write_text("base: base.yaml\ntrain:\n#  steps: 10\noptim:\n")
    config = load_train_config(child)
    assert (config.train.steps, config.train.out_dir, config.train.log_interval) == (5, "runs/a", 1)
    assert config.optim.lr == 0.01
    config = load_train_config(child, ["train.steps=3"])
    assert (config.train.steps, config.train.out_dir) == (3, "runs/a")


def test_an_explicit_null_section_resets_to_the_defaults_and_takes_overrides(base):
    child = base.with_name("child.yaml")
    child.write_text("base: base.yaml\ntrain: null\n")
    config = load_train_config(child, ["train.steps=3"])
    assert (config.train.steps, config.train.out_dir) == (3, "runs/default")


def test_an_empty_mapping_inside_a_section_keeps_the_base_one(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model: {type: drt}\ndata: {kind: needle, filler: repeat, mix: {passkey: 1, vt: 2}}\n"
    )
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ndata:\n  mix:\n  #  passkey: 1\n")
    assert load_train_config(child).data["mix"] == {"passkey": 1, "vt": 2}
    child.write_text("base: base.yaml\ndata:\n  mix: null\n")  # explicit: train data.task alone
    assert load_train_config(child).data["mix"] is None


def test_an_empty_mix_is_refused():
    with pytest.raises(ConfigError, match=r"data\.mix must map each task to its weight"):
        NeedleBatchConfig.from_dict({"mix": {}, "filler": "repeat"}, where="data")
    with pytest.raises(ConfigError, match=r"data\.mix must map each task to its weight"):
        NeedleBatchConfig.from_dict({"mix": ["passkey"], "filler": "repeat"}, where="data")


@pytest.mark.parametrize("section", ["optim: []", "train: 0", "optim: ''", "model: [transformer]"])
def test_a_section_that_is_not_a_mapping_is_refused(base, section):
    child = base.with_name("child.yaml")
    child.write_text(f"base: base.yaml\n{section}\n")
    name = section.split(":")[0]
    with pytest.raises(ConfigError, match=rf"child\.yaml: section '{name}' must be a mapping"):
        load_train_config(child)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "a list"), ("hello\n", "a string"), ("3\n", "a number")])
def test_a_config_that_is_not_a_mapping_is_one_line_with_or_without_set(tmp_path, capsys, text, kind):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    for extra in ([], ["--set", "train.steps=3"]):
        assert main(["train", str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} holds {kind}, not a mapping") and len(err.splitlines()) == 1
    (tmp_path / "child.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match=rf"child\.yaml: its base .*c\.yaml holds {kind}"):
        load_train_config(tmp_path / "child.yaml")
    with pytest.raises(ConfigError, match="--set needs a config that is a mapping"):
        apply_overrides(["a"], ["train.steps=3"])


def test_an_empty_config_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"c\.yaml is empty; write the sections"):
        load_train_config(path)


def test_set_fills_a_null_section_or_mapping():
    raw = apply_overrides({"train": None, "data": {"mix": None}}, ["train.steps=3", "data.mix.vt=1"])
    assert raw == {"train": {"steps": 3}, "data": {"mix": {"vt": 1}}}


def test_set_of_another_model_type_or_data_kind_starts_the_section_afresh_as_a_base_would(base, caplog):
    caplog.set_level(logging.INFO, logger="farsight")
    drt = base.with_name("drt.yaml")
    drt.write_text(BASE.replace("transformer, d_model: 32", "drt, d_model: 32, chunk_size: 8, top_k: 2"))
    # the type's own --set keys apply whether they come before or after the type
    config = load_train_config(drt, ["model.n_layers=2", "model.type=transformer", "data.kind=needle"])
    assert config.model == {"type": "transformer", "n_layers": 2}
    assert config.data == {"kind": "needle"}
    assert "not used: chunk_size, d_model, top_k" in caplog.text
    assert "not used: path, seq_len" in caplog.text
    # the type or kind the section has already (tokens by default): nothing is dropped; the last
    # value given is the one that counts
    config = load_train_config(drt, ["model.type=transformer", "model.type=drt", "data.kind=tokens"])
    assert config.model == {"type": "drt", "d_model": 32, "chunk_size": 8, "top_k": 2}
    assert config.data == {"path": "d", "seq_len": 64, "kind": "tokens"}


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(BASE + "train: {steps: 7}\n")
    with pytest.raises(ConfigError, match=r"'train' is given twice in one mapping at line 5, column 1\); keep one"):
        load_train_config(path)
    path.write_text("model: {type: transformer}\ntrain:\n  steps: 3\n  steps: 7\n")
    with pytest.raises(ConfigError, match="'steps' is given twice in one mapping at line 4"):
        load_train_config(path)
    merged = tmp_path / "merged.yaml"  # a key a YAML merge (<<) brings in may be given again
    merged.write_text(BASE.replace("data: {path: d, seq_len: 64}", "data: {<<: {path: d, seq_len: 64}, seq_len: 32}"))
    assert load_train_config(merged).data["seq_len"] == 32


@pytest.mark.parametrize(
    "override, problem",
    [
        ("train.seed=-1", r"train.seed must be in \[0, 2\*\*32 - 1\], got -1"),
        ("train.seed=4294967296", r"train.seed must be in \[0, 2\*\*32 - 1\], got 4294967296"),
        ("optim.lr=.inf", "optim.lr must be a finite number, got inf"),
        ("optim.weight_decay=.nan", "optim.weight_decay must be a finite number, got nan"),
    ],
)
def test_seeds_numpy_cannot_take_and_numbers_that_are_not_finite_are_refused(base, override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_train_config(base, [override])


def test_configs_built_in_python_are_type_checked_as_files_are():
    from farsight.models import DRTConfig
    from farsight.train.config import OptimConfig

    with pytest.raises(ConfigError, match="DRTConfig.gumbel must be true or false, got 'false'"):
        DRTConfig(gumbel="false")  # a truthy string would have kept Gumbel noise on
    with pytest.raises(ConfigError, match="DRTConfig.norm_eps must be a number, got '1e-5'"):
        DRTConfig(norm_eps="1e-5")
    with pytest.raises(ConfigError, match="OptimConfig.lr must be a finite number"):
        OptimConfig(lr=float("inf"))
    import numpy as np

    config = DRTConfig(d_model=np.int64(64), norm_eps=np.float32(1e-5))  # numpy scalars are numbers
    assert type(config.d_model) is int and type(config.norm_eps) is float


def test_a_home_folder_in_a_path_field_is_expanded_as_a_shell_would(base, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_train_config(base, ["data.path=~/tokens", "train.out_dir=~/runs/x", "train.init_from=~/runs/a"])
    assert (config.data["path"], config.train.out_dir, config.train.init_from) == (
        f"{tmp_path}/tokens",
        f"{tmp_path}/runs/x",
        f"{tmp_path}/runs/a",
    )
