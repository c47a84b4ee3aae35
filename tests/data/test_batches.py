import pytest

from farsight.config import ConfigError
from farsight.data.batches import DATA_KINDS, build_batch_source
from farsight.data.tasks.training import NeedleBatches


def test_data_kinds_are_tokens_needle_and_sft():
    assert sorted(DATA_KINDS) == ["needle", "sft", "tokens"]


def test_build_batch_source_picks_the_kind():
    source = build_batch_source({"kind": "needle", "filler": "repeat", "seq_len": 128, "batch_tokens": 256}, seed=0)
    assert isinstance(source, NeedleBatches)
    assert source.train_batch(0, 0, 0)["input_ids"].shape == (2, 128)
    with pytest.raises(
        ConfigError, match=r"data.kind='pictures' is unknown; choose one of \['needle', 'sft', 'tokens'\]"
    ):
        build_batch_source({"kind": "pictures"}, seed=0)
