"""A farsight model directory loads in a process that never imports farsight.hf: config.json's
auto_map names the classes of farsight_hf.py, a shim that only imports the installed farsight
package, which transformers imports for trust_remote_code=True (lm-eval's plain command line)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import farsight.hf
from farsight.errors import ModelFileError
from farsight.models import export_model, load_model
from farsight.models.io import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    HF_SHIM,
    HF_SHIM_FILE,
    WEIGHTS_FILE,
    hf_entries,
    read_model_meta,
    stored_dtype,
    verify_model_dir,
    write_checksums,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(path for path in (REPO / "models").iterdir() if path.is_dir())  # every model the repository ships
FILES = (CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", HF_SHIM_FILE)


def test_auto_map_names_the_classes_of_each_model_type():
    for model_type, config_class in farsight.hf.CONFIG_CLASSES.items():
        auto_map = hf_entries(model_type, None)["auto_map"]
        names = {name.split(".")[1] for name in (auto_map["AutoConfig"], auto_map["AutoModelForCausalLM"])}
        assert names == {config_class.__name__, farsight.hf.MODEL_CLASSES[model_type].__name__}
        assert auto_map["AutoTokenizer"] == [None, "farsight_hf.FarsightTokenizerFast"]
        assert all(f"{name}," in HF_SHIM for name in names)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_models_carry_the_shim_auto_map_and_stored_dtype(path):
    meta = read_model_meta(path)
    assert meta["auto_map"] == hf_entries(meta["model_type"], None)["auto_map"]
    assert meta["dtype"] == str(stored_dtype(path)).removeprefix("torch.")
    assert (path / HF_SHIM_FILE).read_text() == HF_SHIM
    assert set(verify_model_dir(path)) == set(FILES)  # checksums.json lists every file, and they match


def test_the_shim_imports_farsights_classes_and_names_the_install_when_farsight_is_missing(tiny_drt_dir, monkeypatch):
    code = compile((tiny_drt_dir / HF_SHIM_FILE).read_text(), HF_SHIM_FILE, "exec")
    namespace = {}
    exec(code, namespace)
    assert namespace["FarsightDRTForCausalLM"] is farsight.hf.FarsightDRTForCausalLM
    monkeypatch.setitem(sys.modules, "farsight.hf", None)  # as if farsight were not installed
    with pytest.raises(ImportError, match=r"needs the farsight package: pip install 'farsight\[hf\]'") as error:
        exec(code, {})
    assert "\n" not in str(error.value)


def test_a_directory_whose_shim_is_not_farsights_is_refused(tiny_drt_dir, tmp_path):
    copy = Path(shutil.copytree(tiny_drt_dir, tmp_path / "model"))
    (copy / HF_SHIM_FILE).write_text(HF_SHIM + "import os\nos.system('echo hi')\n")
    write_checksums(copy, FILES)  # recorded anew: the checksums alone would not catch it
    with pytest.raises(ModelFileError, match=f"{HF_SHIM_FILE} is not the file farsight writes") as error:
        load_model(copy)
    assert "\n" not in str(error.value)


def test_export_adds_the_shim_auto_map_and_dtype_to_an_older_directory(tiny_drt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    older = Path(shutil.copytree(tiny_drt_dir, tmp_path / "older"))  # as an older farsight wrote it
    meta = read_model_meta(older)
    (older / CONFIG_FILE).write_text(json.dumps({k: meta[k] for k in ("model_type", "farsight_version", "config")}))
    (older / HF_SHIM_FILE).unlink()
    write_checksums(older, FILES)
    export_model(older, tmp_path / "out", dtype="bf16")
    out = tmp_path / "out"
    assert read_model_meta(out)["auto_map"] == meta["auto_map"] and read_model_meta(out)["dtype"] == "bfloat16"
    assert (out / HF_SHIM_FILE).read_text() == HF_SHIM
    assert set(json.loads((out / CHECKSUMS_FILE).read_text())["files"]) == set(FILES)
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_the_lm_eval_command_line_loads_a_farsight_directory_with_trust_remote_code(tiny_drt_dir, tmp_path):
    """`lm_eval --model hf` in a fresh process (nothing imports farsight.hf but the shim)."""
    pytest.importorskip("lm_eval")
    data = tmp_path / "tasks" / "docs.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"context": "The passkey is 4821.", "choices": [" 4821", " 1234"], "answer": 0}) + "\n")
    (data.parent / "mc.yaml").write_text(
        f"task: farsight_remote_mc\noutput_type: multiple_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{context}} The passkey is"\ntarget_delimiter: ""\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [sys.executable, "-m", "lm_eval", "--model", "hf", "--device", "cpu", "--tasks", "farsight_remote_mc"]
    argv += ["--include_path", str(data.parent), "--limit", "1", "--output_path", str(tmp_path / "results")]
    argv += ["--model_args", f"pretrained={tiny_drt_dir},trust_remote_code=True"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = (tmp_path / "results").rglob("results_*.json")
    assert "acc,none" in json.loads(results.read_text())["results"]["farsight_remote_mc"]
