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


def _needle_source(chunk_size=1, **options):
    config = {"kind": "needle", "filler": "repeat", "seq_len": 512, "batch_tokens": 2048, "align": 1}
    mix = {"mix": {"niah_single_1": 1, "niah_multikey_2": 1}}
    return build_batch_source(config | mix | options, seed=0, model={"chunk_size": chunk_size})


def test_supervised_retrieval_marks_the_evidence_and_the_answer():
    source = _needle_source(retrieval_weight=0.5, lm_fraction=0.3)
    assert source.retrieval_weight == 0.5
    batch = source.train_batch(3, 0, 0)
    targets, ids = batch["retrieval_targets"], batch["input_ids"]
    assert targets.shape == ids.shape and set(targets.unique().tolist()) <= {0, 1, 2}
    marked = 0
    for row in range(ids.shape[0]):
        evidence, answer = ids[row][targets[row] == 1], ids[row][targets[row] == 2]
        if len(answer) == 0:  # a plain-text row: nothing marked
            assert not bool(targets[row].any())
            continue
        # a needle's value is the answer: the same tokens, written before the question
        assert evidence.tolist() == answer.tolist()
        assert int((targets[row] == 1).nonzero().max()) < int((targets[row] == 2).nonzero().min())
        assert (batch["loss_weights"][row][targets[row] == 2] == 10.0).all()
        marked += 1
    assert marked >= 1


def test_only_answer_tokens_whose_retrieval_read_the_question_are_marked():
    """With chunks of 8, an answer token's retrieval was made at the end of the chunk before its
    own: it is supervised only if that chunk ended after the question's head (the asked key)."""
    source = _needle_source(chunk_size=8, retrieval_weight=1.0)
    marked = skipped = 0
    for step in range(6):
        batch = source.train_batch(step, 0, 0)
        for targets, weights in zip(batch["retrieval_targets"], batch["loss_weights"]):
            answer = (targets == 2).nonzero().flatten().tolist()
            answer_tokens = (weights == 10.0).nonzero().flatten().tolist()
            question_end = answer_tokens[0] - 3  # " is" links the question's head to the value in both tasks
            for p in answer_tokens:
                assert (p in answer) == (p // 8 * 8 >= question_end), (step, p)
            marked += len(answer)
            skipped += len(answer_tokens) - len(answer)
    assert marked and skipped


def test_without_supervised_retrieval_the_batches_are_what_they_were():
    plain, supervised = _needle_source(), _needle_source(retrieval_weight=1.0)
    assert plain.retrieval_weight == 0.0 and "retrieval_targets" not in plain.train_batch(0, 0, 0)
    for name, tensor in plain.train_batch(2, 0, 0).items():
        assert tensor.equal(supervised.train_batch(2, 0, 0)[name]), name


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (-1, "data.retrieval_weight must be >= 0, got -1"),
        ("high", "data.retrieval_weight must be a number, got 'high'"),
    ],
)
def test_a_bad_retrieval_weight_is_refused_in_one_line(weight, message):
    with pytest.raises(ConfigError, match=message):
        _needle_source(retrieval_weight=weight)
