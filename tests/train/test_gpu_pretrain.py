"""experiments/gpu_pretrain.py: what comes back from a lent GPU machine (bf16 weights, 8-bit AdamW
moments, the corpus archive) decodes to what was packed, and a run cut off there resumes from its
reassembled checkpoint."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.train.conftest import tiny_config

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def gp():
    spec = importlib.util.spec_from_file_location("gpu_pretrain", ROOT / "experiments" / "gpu_pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bf16_planes_round_trip(gp):
    x = torch.randn(3001) * 0.05
    data = gp._bf16_bytes(x)
    assert gp.decode_bf16(gp.encode_bf16(data), 3001) == data
    assert len(gp.encode_bf16(data)) < len(data)  # the sign-and-exponent bytes deflate


def test_moments_come_back_within_the_8_bit_float_error(gp):
    m = torch.randn(5000) * 1e-3
    v = m.square() * (1 + torch.rand(5000))
    v[:10] = 0
    m2 = gp.decode_moment(gp.encode_moment(m, False), [5000], False)
    v2 = gp.decode_moment(gp.encode_moment(v, True), [5000], True)
    assert ((m2 - m).norm() / m.norm()).item() < 0.05
    assert ((v2 - v).norm() / v.norm()).item() < 0.1
    assert (v2 > 0).all()  # no root rounded to zero: an update is never divided by eps alone


def test_corpus_archive_round_trip_and_checksum(gp, token_dir, tmp_path):
    archive = tmp_path / "corpus.tar.xz"
    gp.pack_corpus(token_dir, archive)
    first = archive.read_bytes()
    gp.pack_corpus(token_dir, archive)
    assert archive.read_bytes() == first  # the same files give the same archive
    gp.unpack_corpus(archive, tmp_path / "tokens")
    for name in json.loads(Path(f"{archive}.json").read_text())["files"]:
        assert (tmp_path / "tokens" / name).read_bytes() == (token_dir / name).read_bytes()
    with pytest.raises(SystemExit, match="SHA-256"):
        gp.unpack_corpus(archive, tmp_path / "other", expect="0" * 64)


def test_a_cut_off_run_resumes_from_its_reassembled_checkpoint(gp, token_dir, tmp_path):
    from farsight.models import load_model
    from farsight.train.trainer import train

    runs = tmp_path / "runs"
    (runs).mkdir()
    (runs / "plan.json").write_text(json.dumps({"steps": 6}))
    train(tiny_config(token_dir, runs / "cut", steps=3))  # the GPU run, stopped at step 3 of 6
    train(tiny_config(token_dir, runs / "done", steps=6))
    out = tmp_path / "out"
    gp.pack(out, {"runs": runs, "models": ["done", "cut"], "extra": []})
    record = json.loads((out / "pack.json").read_text())
    assert [(i["model"], i["kind"]) for i in record["items"]] == [
        ("done", "weights"),
        ("cut", "weights"),
        ("cut", "moments"),
    ]
    back = tmp_path / "back"
    gp.reassemble(out, back)
    packed = load_model(runs / "done").state_dict()
    reassembled = load_model(back / "done").state_dict()
    assert all(torch.equal(packed[k].to(torch.bfloat16).float(), reassembled[k]) for k in packed)
    result = train(tiny_config(token_dir, back / "cut", steps=6))
    assert result.status == "completed" and result.step == 6
    steps = [r["step"] for r in map(json.loads, (back / "cut" / "metrics.jsonl").read_text().splitlines())]
    assert steps[:3] == [1, 2, 3] and steps[-1] == 6  # steps 1-3 from the GPU run, 4-6 resumed
    # a corrupted part is refused
    part = out / "payload.part00"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="SHA-256"):
        gp.reassemble(out, tmp_path / "again")
