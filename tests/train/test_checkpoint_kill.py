import json
import subprocess
import sys

import yaml

from farsight.models import load_model
from farsight.train.checkpoint import list_checkpoints, load_trainer_state, verify_checkpoint
from farsight.train.trainer import train
from tests.train.conftest import tiny_config

# A `farsight train` process that SIGKILLs itself on the nth call of module.attr (before the call runs).
CHILD = """
import importlib, os, signal, sys
module, attr, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = importlib.import_module(module)
real = getattr(target, attr)
calls = []
def kill_on_nth(*args, **kwargs):
    calls.append(None)
    if len(calls) == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
setattr(target, attr, kill_on_nth)
from farsight.cli import main
sys.exit(main(["train", *sys.argv[4:]]))
"""

# Moments inside a checkpoint write: the model files, the trainer state, the manifest check,
# after the rename into place, and while an old checkpoint is being removed.
KILL_POINTS = [
    ("safetensors.torch", "save_file", 3),
    ("farsight.train.checkpoint", "_write_state", 2),
    ("farsight.train.checkpoint", "sha256_file", 15),  # 6 files checked on resume, 6 per checkpoint
    ("farsight.train.checkpoint", "_fsync_dir", 2),
    ("shutil", "rmtree", 2),
]


def write_config(token_dir, out_dir, path, **train):
    path.write_text(yaml.safe_dump(tiny_config(token_dir, out_dir, **train).to_dict()))
    return path


def run_killed(config_path, module, attr, nth, *args):
    """Run `farsight train config_path *args` until it kills itself at (module, attr, nth); its return code and output."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, module, attr, str(nth), str(config_path), "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


def assert_newest_checkpoint_loads(run_dir):
    (step, newest), *_ = reversed(list_checkpoints(run_dir / "checkpoints"))
    load_model(newest)
    assert load_trainer_state(newest)["step"] == step
    return step


def test_sigkill_while_checkpointing_never_breaks_the_newest_checkpoint(token_dir, tmp_path):
    run = tmp_path / "run"
    config = write_config(token_dir, run, tmp_path / "c.yaml", steps=12, checkpoint_interval=1, keep_last=2)
    last = 0
    for module, attr, nth in KILL_POINTS:
        code, output = run_killed(config, module, attr, nth)
        assert code == -9, output  # killed where asked, not finished or failed
        step = assert_newest_checkpoint_loads(run)
        assert step > last, (module, attr)  # the killed run resumed from the previous one and got further
        for _, path in list_checkpoints(run / "checkpoints"):
            verify_checkpoint(path)  # nothing half-written or half-deleted under a final name
        last = step
    result = train(tiny_config(token_dir, run, steps=12, checkpoint_interval=1, keep_last=2))
    assert result.status == "completed" and result.step == 12
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == list(range(1, 13))
