"""`retrieval_top_k` and `retrieval_neighbors` through Hugging Face's from_pretrained and
farsight's lm-eval model."""

from __future__ import annotations

import pytest
import torch

from farsight.errors import InputError


def test_from_pretrained_reads_k_chunks_and_its_config_says_so(tiny_drt_dir):
    from transformers import AutoModelForCausalLM

    import farsight.hf  # noqa: F401  (registers the farsight model types)

    trained = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    fewer = AutoModelForCausalLM.from_pretrained(tiny_drt_dir, retrieval_top_k=1)
    assert trained.model.config.top_k == trained.config.config["top_k"] == 2
    assert fewer.model.config.top_k == fewer.config.config["top_k"] == 1
    ids = torch.randint(0, 256, (1, 70))
    with torch.no_grad():
        assert not torch.equal(trained(ids).logits, fewer(ids).logits)


def test_from_pretrained_refuses_k_for_a_model_without_retrieval(castle_dir):
    from transformers import AutoModelForCausalLM

    import farsight.hf  # noqa: F401

    with pytest.raises(InputError, match="'transformer' model; drop the option"):
        AutoModelForCausalLM.from_pretrained(castle_dir, retrieval_top_k=2)


@pytest.mark.parametrize(("given", "read"), [(1, 1), ("1", 1)])
def test_lm_eval_model_args_set_k(tiny_drt_dir, given, read):
    pytest.importorskip("lm_eval")
    from farsight.hf.harness import FarsightLM

    assert FarsightLM(str(tiny_drt_dir), retrieval_top_k=given).model.config.top_k == read
    with pytest.raises(InputError, match="whole number >= 1"):
        FarsightLM(str(tiny_drt_dir), retrieval_top_k="two")


def test_lm_evals_own_hf_model_passes_k_from_its_model_args(tiny_drt_dir):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    import farsight.hf  # noqa: F401

    lm = HFLM.create_from_arg_string(f"pretrained={tiny_drt_dir},retrieval_top_k=1,device=cpu,dtype=float32")
    assert lm.model.model.config.top_k == 1


def test_from_pretrained_reads_neighbors_and_its_config_says_so(tiny_drt_dir):
    from transformers import AutoModelForCausalLM

    import farsight.hf  # noqa: F401

    trained = AutoModelForCausalLM.from_pretrained(tiny_drt_dir)
    wider = AutoModelForCausalLM.from_pretrained(tiny_drt_dir, retrieval_neighbors="0:1")
    assert (wider.model.config.neighbors_before, wider.model.config.neighbors_after) == (0, 1)
    assert (wider.config.config["neighbors_before"], wider.config.config["neighbors_after"]) == (0, 1)
    ids = torch.randint(0, 256, (1, 70))
    with torch.no_grad():
        assert not torch.equal(trained(ids).logits, wider(ids).logits)
    with pytest.raises(InputError, match="BEFORE:AFTER"):
        AutoModelForCausalLM.from_pretrained(tiny_drt_dir, retrieval_neighbors="wide")


@pytest.mark.parametrize(("given", "read"), [(1, (1, 1)), ("0:2", (0, 2))])
def test_lm_eval_model_args_set_neighbors(tiny_drt_dir, given, read):
    pytest.importorskip("lm_eval")
    from farsight.hf.harness import FarsightLM

    config = FarsightLM(str(tiny_drt_dir), retrieval_neighbors=given).model.config
    assert (config.neighbors_before, config.neighbors_after) == read


def test_lm_evals_own_hf_model_passes_neighbors_from_its_model_args(tiny_drt_dir):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    import farsight.hf  # noqa: F401

    lm = HFLM.create_from_arg_string(f"pretrained={tiny_drt_dir},retrieval_neighbors=1:0,device=cpu,dtype=float32")
    assert (lm.model.model.config.neighbors_before, lm.model.model.config.neighbors_after) == (1, 0)
