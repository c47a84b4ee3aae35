#!/usr/bin/env python3
"""The steps of experiments/gpu-pretrain.sh (its header says how to run them and what each setting
does): pack the BPE token corpus into one checksummed xz archive, pre-train the BPE models on a
lent GPU within one call's time, pack what comes back into a few files of at most 15 MiB, and
turn those files into ordinary run directories again.

    pack-corpus  TOKENS_DIR ARCHIVE        the prepared token dataset -> ARCHIVE (+ ARCHIVE.json)
    unpack-corpus ARCHIVE TOKENS_DIR       ARCHIVE -> the dataset, every file checked by SHA-256
    train OUT_DIR                          unpack, measure, plan, train, pack into OUT_DIR (env settings)
    pack OUT_DIR                           only the packing step of `train`
    reassemble PACK_DIR RUNS_DIR           packed files -> RUNS_DIR/MODEL run directories, checked by SHA-256

What comes back from the GPU machine is limited (8 files, 64 MiB together), and a 13M-parameter
model's checkpoint (fp32 weights and two AdamW moments) is 157 MB. So a finished model comes back
as its weights rounded to bf16 (the sign-and-exponent bytes deflated: about 70% of 2 bytes a
parameter), and a model cut off by the time limit as bf16 weights plus its AdamW moments in 8-bit
floats with a scale per block of 1024 (about 3.4 bytes a parameter): enough for `farsight train`
to resume it, with the weights and moments rounded once. Everything else of the run (config,
metrics, the newest checkpoint's JSON files and small tensors) travels exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from farsight.files import sha256_file

START = time.monotonic()
PART_BYTES = 15 << 20  # each payload part: under the 16 MiB a returned file may have
RETURN_BYTES = 64 << 20  # all returned files together
RETURN_FILES = 8
BLOCK = 1024  # elements per scale of the 8-bit moments
FP8_MAX = 448.0  # the largest float8_e4m3fn
PLAN_FILE = "plan.json"
PACK_FILE = "pack.json"
SMALL_FILE = "runs.tar.xz"
LOG_FILE = "log.txt"
MOMENTS = ("exp_avg", "exp_avg_sq")
TINY = ["model.d_model=64", "model.n_layers=4", "model.n_heads=2"]  # DRY_RUN's model
# What a model's probe tries, in order, until one runs: the defaults; not compiled (a compiled model
# whose gradient vanished stops with an error); also the PyTorch paths instead of farsight's Triton
# kernels. The run keeps the first setting its probe ran with. (environment, `--set` overrides)
FALLBACKS: list[tuple[dict[str, str], list[str]]] = [
    ({}, []),
    ({}, ["train.compile=false"]),
    ({"FARSIGHT_TRITON": "0"}, ["train.compile=false"]),
]


def say(message: str) -> None:
    print(f"[gpu-pretrain {time.monotonic() - START:6.1f}s] {message}", flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the corpus -------------------------------------------------------------------------------


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    """A member with fixed metadata, so the same files give the same archive bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    return info


def pack_corpus(tokens: Path, archive: Path) -> None:
    """The files of a prepared token dataset -> one xz tar (deterministic) and ARCHIVE.json."""
    meta = json.loads((tokens / "meta.json").read_text())
    names = sorted(p.name for p in tokens.iterdir() if p.is_file())
    files = {name: {"bytes": (tokens / name).stat().st_size, "sha256": sha256_file(tokens / name)} for name in names}
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    began = time.monotonic()
    with open(tmp, "wb") as raw:
        with lzma.open(raw, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for name in names:
                with open(tokens / name, "rb") as handle:
                    tar.addfile(_tar_info(f"{tokens.name}/{name}", files[name]["bytes"]), handle)
    os.replace(tmp, archive)
    record = {
        "archive": archive.name,
        "bytes": archive.stat().st_size,
        "sha256": sha256_file(archive),
        "dataset": tokens.name,
        "files": files,
        "tokens": {split: meta["splits"][split]["tokens"] for split in meta["splits"]},
        "documents": {split: meta["splits"][split]["documents"] for split in meta["splits"]},
        "vocab_size": meta["vocab_size"],
        "dtype": meta["dtype"],
    }
    Path(f"{archive}.json").write_text(json.dumps(record, indent=2) + "\n")
    raw_bytes = sum(f["bytes"] for f in files.values())
    print(
        f"{archive}: {record['bytes'] / 1e6:.1f} MB from {raw_bytes / 1e6:.1f} MB in {time.monotonic() - began:.0f}s; "
        f"tokens {record['tokens']}; sha256 {record['sha256']}"
    )


def unpack_corpus(archive: Path, dest: Path, expect: str | None = None) -> None:
    """ARCHIVE (checked against ARCHIVE.json and `expect`) -> dest, every file checked by SHA-256;
    a dest that already holds the same files is kept."""
    record = json.loads(Path(f"{archive}.json").read_text())
    if dest.is_dir() and all(
        (dest / name).is_file() and (dest / name).stat().st_size == entry["bytes"]
        for name, entry in record["files"].items()
    ):
        if all(sha256_file(dest / name) == entry["sha256"] for name, entry in record["files"].items()):
            say(f"corpus: {dest} already holds the archive's files (checked by SHA-256)")
            return
    digest = sha256_file(archive)
    for wanted, where in ((record["sha256"], f"{archive}.json"), (expect, "CORPUS_SHA256")):
        if wanted and digest != wanted:
            sys.exit(f"error: {archive} has SHA-256 {digest}, not the {wanted} of {where}; carry the archive again")
    say(f"corpus: {archive} ({archive.stat().st_size / 1e6:.1f} MB) has the expected SHA-256 {digest}")
    scratch = dest.with_name(dest.name + ".unpacking")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not member.isfile() or name not in record["files"]:
                sys.exit(f"error: {archive} holds {member.name!r}, which {archive}.json does not list")
            with tar.extractfile(member) as source, open(scratch / name, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    for name, entry in record["files"].items():
        if sha256_file(scratch / name) != entry["sha256"]:
            sys.exit(f"error: {name} unpacked from {archive} does not match its SHA-256")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(scratch, dest)
    say(f"corpus: unpacked {dest}, {len(record['files'])} files checked; tokens {record['tokens']}")


# ---- settings ---------------------------------------------------------------------------------


def settings() -> dict[str, Any]:
    """The run's settings from the environment (experiments/gpu-pretrain.sh's header lists them)."""
    dry = os.environ.get("DRY_RUN") == "1"
    env = os.environ.get

    def number(name: str, default: float) -> float:
        return float(env(name, default))

    s = {
        "dry_run": dry,
        "models": env("MODELS", "drt-x2 baselm-2l").split(),
        "extra": env("EXTRA", "drt-x1").split(),
        "tokens": int(number("TOKENS", 300_000 if dry else 100_000_000)),
        "adapt": env("ADAPT", "1") == "1",
        "seq_len": int(number("SEQ", 1024 if dry else 4096)),
        "batch": int(number("BATCH", 2 if dry else 16)),
        "budget_s": number("BUDGET_S", 420 if dry else 540),
        "reserve_s": number("RESERVE_S", 45),
        "model_limit_s": number("MODEL_LIMIT_S", 0),
        "rate": number("RATE", 400 if dry else 500_000),  # tokens/s assumed where none was measured
        "checkpoint_s": number("CKPT_S", 10 if dry else 120),
        "probe_steps": int(number("PROBE_STEPS", 10 if dry else 40)),
        "warmup_tokens": int(number("WARMUP_TOKENS", 40_960 if dry else 3_276_800)),
        "precision": env("PRECISION", "fp32" if dry else "bf16-mixed"),
        "compile": env("COMPILE", "false" if dry else "true"),
        "device": env("DEVICE", "cpu" if dry else "cuda"),
        "eval_batches": int(number("EVAL_BATCHES", 2 if dry else 8)),
        "runs": Path(env("RUNS", "runs/gpu-pretrain-dry" if dry else "runs/gpu-pretrain")),
        "configs": Path(env("CONFIGS", "configs/bpe/pretrain")),
        "data": env("DATA", "data/code-bpe16k-tokens"),
        "set": (TINY if dry else []) + env("SET", "").split(),
    }
    s["tokens_per_step"] = s["seq_len"] * s["batch"]
    s["warmup_steps"] = max(s["probe_steps"], round(s["warmup_tokens"] / s["tokens_per_step"]))
    return s


def python() -> str:
    venv = Path(".venv/bin/python")
    return os.environ.get("PYTHON") or (str(venv) if venv.exists() else sys.executable)


def model_sets(model: str) -> list[str]:
    """SET_<MODEL> (the name upper-cased, "-" as "_"): `--set` overrides for that model alone,
    e.g. SET_DRT_X2="train.compile=false"."""
    return os.environ.get("SET_" + model.upper().replace("-", "_"), "").split()


def train_command(s: dict[str, Any], model: str, steps: int, extra: list[str]) -> list[str]:
    """`farsight train` of configs/bpe/pretrain/MODEL.yaml with this run's data, length and budget."""
    sets = [
        f"train.out_dir={s['runs'] / model}",
        f"data.path={s['data']}",
        f"data.seq_len={s['seq_len']}",
        f"data.batch_size={s['batch']}",
        f"optim.warmup_steps={s['warmup_steps']}",
        f"train.steps={steps}",
        f"train.precision={s['precision']}",
        f"train.compile={s['compile']}",
        f"train.device={s['device']}",
        f"train.eval_batches={s['eval_batches']}",
        "train.keep_last=2",
        *s["set"],
        *model_sets(model),
        *extra,
    ]
    command = [python(), "-m", "farsight.cli", "train", str(s["configs"] / f"{model}.yaml"), "--no-progress"]
    for item in sets:
        command += ["--set", item]
    return command


def run_training(
    command: list[str], limit_s: float, log_prefix: str, grace_s: float, env: dict[str, str] | None = None
) -> tuple[int, float, bool]:
    """Run `farsight train` (with `env` added to the environment), its output into ours; after
    limit_s a SIGINT (the trainer checkpoints and stops), grace_s later a SIGKILL. (exit status,
    wall seconds, stopped by the limit)."""
    began = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, **(env or {})},
    )

    def forward() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"{log_prefix} {line}", end="", flush=True)

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    stopped = False
    try:
        process.wait(timeout=max(1.0, limit_s))
    except subprocess.TimeoutExpired:
        stopped = True
        say(f"{log_prefix} time limit of {limit_s:.0f}s reached: SIGINT (the trainer saves a checkpoint and stops)")
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    except KeyboardInterrupt:  # the script itself interrupted: let the trainer save first
        process.send_signal(signal.SIGINT)
        process.wait()
        raise
    reader.join(timeout=10)
    return process.returncode, time.monotonic() - began, stopped


def grace(s: dict[str, Any]) -> float:
    """Seconds a run gets after its SIGINT to finish its step and save (then SIGKILL): part of the
    reserve, so that packing still ends within BUDGET_S."""
    return max(10.0, s["reserve_s"] - 15)


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def measured_rate(run: Path, after_step: int) -> float | None:
    """The median tokens/s of the logged intervals after `after_step` that compiled nothing."""
    rows = [r for r in read_metrics(run) if "tokens_per_s" in r and "compile_s" not in r and r["step"] > after_step]
    return statistics.median(r["tokens_per_s"] for r in rows) if rows else None


def latest_step(run: Path) -> int:
    found = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    return found[-1] if found else 0


# ---- the GPU run ------------------------------------------------------------------------------


def train(out: Path) -> int:
    s = settings()
    deadline = START + s["budget_s"]
    say(
        "settings: "
        + json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in s.items()}, separators=(",", ":"))
    )
    began = time.monotonic()
    archive = Path(os.environ.get("CORPUS", "data/gpu-pretrain/corpus.tar.xz"))
    if archive.exists():
        unpack_corpus(archive, Path(s["data"]), os.environ.get("CORPUS_SHA256"))
    elif not (Path(s["data"]) / "meta.json").exists():
        sys.exit(f"error: neither {archive} nor {s['data']} is here; carry data/gpu-pretrain (see the script's header)")
    corpus_s = time.monotonic() - began
    say(f"stage corpus: {corpus_s:.1f}s")
    s["runs"].mkdir(parents=True, exist_ok=True)
    plan_path = s["runs"] / PLAN_FILE
    keys = ("seq_len", "batch", "warmup_steps", "set", "data")
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    if plan is not None and any(plan["settings"].get(k) != s[k] for k in keys):
        sys.exit(f"error: {plan_path} was planned with other settings ({plan['settings']}); use another RUNS folder")
    status = 0
    try:
        if plan is None:
            plan = make_plan(s, deadline)
            plan_path.write_text(json.dumps(plan, indent=2) + "\n")
        else:
            say(f"resuming the plan of {plan_path}: {plan['steps']} steps ({plan['tokens']:,} tokens) per model")
        status = train_planned(s, plan, deadline, out)
    except KeyboardInterrupt:
        say("interrupted: packing what there is")
        status = 130
    finally:
        began = time.monotonic()
        pack(out, s)
        say(f"stage pack: {time.monotonic() - began:.1f}s")
    return status


def make_plan(s: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Measure each model's tokens/s on the first PROBE_STEPS steps (within the warmup, whose
    learning rates do not depend on the run's length, so those steps are the run's own), then fix
    the steps every model trains: TOKENS, or with ADAPT=1 fewer, so that all MODELS finish in the
    time left. EXTRA models train afterwards with the same steps if time is left."""
    tps = s["tokens_per_step"]
    rates: dict[str, float] = {}
    overheads: dict[str, float] = {}
    fallbacks: dict[str, int] = {}
    if s["adapt"]:
        for model in s["models"]:
            run = s["runs"] / model
            wall = 0.0
            if latest_step(run) < s["probe_steps"]:
                found = probe(s, model, deadline)
                if found is None:
                    continue
                fallbacks[model], wall = found
            rate = measured_rate(run, 5) or measured_rate(run, 0)
            if rate is None:
                say(f"{model}: skipped, {run}/metrics.jsonl holds no tokens/s to plan with")
                continue
            rates[model] = rate
            # the probe's start-up beyond its steps, compilation included; the run that resumes it
            # finds the compiled kernels cached (on an H200 it took a fifth to two fifths of the
            # probe's), so half of it is planned for the run
            overheads[model] = max(15.0, 0.5 * (wall - s["probe_steps"] * tps / rate))
            say(f"{model}: {rate:,.0f} tokens/s; start-up, compile, evaluation and saving {overheads[model]:.0f}s")
        if not rates:
            sys.exit("error: no model's probe ran; see the log above")
        left = deadline - time.monotonic() - s["reserve_s"]
        fits = (0.9 * left - sum(overheads.values())) / sum(1 / r for r in rates.values())
        tokens = min(s["tokens"], int(fits))
        say(f"{left:.0f}s left: {fits:,.0f} tokens per model would fit")
        # the speed each of MODELS would need for 100M tokens in the time left, besides each model's
        # start-up, compilation, evaluations and saving (their measured rates give `fits`)
        need = 100_000_000 * len(rates) / max(1.0, 0.9 * left - sum(overheads.values()))
        measured = ", ".join(f"{m} {r:,.0f}" for m, r in rates.items())
        say(
            f"100M tokens for each of {len(rates)} models in this call need {need:,.0f} tokens/s each (measured: {measured})"
        )
    else:
        tokens = s["tokens"]
    # TOKENS is a floor (whole steps of at least that many tokens); a count cut down to fit the time is not
    steps = max(s["probe_steps"] + 1, -(-tokens // tps) if tokens == s["tokens"] else tokens // tps)
    say(f"plan: {steps} steps of {tps:,} tokens = {steps * tps:,} tokens per model")
    plan = {
        "settings": {k: s[k] for k in ("seq_len", "batch", "warmup_steps", "set", "data")},
        "tokens": steps * tps,
        "steps": steps,
        "tokens_per_step": tps,
        "rates": rates,
        "overheads": overheads,
        "models": list(rates) if s["adapt"] else s["models"],
        "extra": s["extra"],
        "fallbacks": fallbacks,
    }
    return plan


def probe(s: dict[str, Any], model: str, deadline: float) -> tuple[int, float] | None:
    """Train `model`'s first PROBE_STEPS steps with the first of FALLBACKS that runs (a failed
    attempt's folder is kept beside the run as MODEL.failed-N). (its index, wall seconds), or
    None when none ran."""
    run = s["runs"] / model
    quiet = ["train.log_interval=5", "train.eval_interval=1000000", "train.checkpoint_interval=1000000"]
    for index, (env, sets) in enumerate(FALLBACKS):
        limit = deadline - time.monotonic() - s["reserve_s"]
        if limit < 30:
            say(f"{model}: no time left to probe")
            return None
        command = train_command(s, model, s["probe_steps"], [*quiet, *sets])
        code, wall, _ = run_training(command, limit, f"[probe {model}]", grace(s), env)
        if code == 0 and latest_step(run) >= s["probe_steps"]:
            say(f"stage probe {model}: {wall:.1f}s" + (f" with {env} {sets}" if index else ""))
            return index, wall
        failed = run.with_name(f"{model}.failed-{index}")
        if run.exists():
            shutil.rmtree(failed, ignore_errors=True)
            run.rename(failed)
        more = f"; trying {FALLBACKS[index + 1]}" if index + 1 < len(FALLBACKS) else "; skipping it"
        say(f"the probe of {model} with {env} {sets} exited with {code} after {wall:.1f}s{more}")
    return None


def train_planned(s: dict[str, Any], plan: dict[str, Any], deadline: float, out: Path) -> int:
    steps, tps = plan["steps"], plan["tokens_per_step"]
    status = 0
    rates = plan.get("rates") or {}
    default_rate = min(rates.values()) if rates else s["rate"]
    fallbacks = plan.get("fallbacks") or {}
    extra_fallback = max(fallbacks.values(), default=0)  # models not probed take the furthest one needed
    for model in [*plan["models"], *plan["extra"]]:
        run = s["runs"] / model
        done = latest_step(run)
        if done >= steps:
            say(f"{model}: finished ({done} steps)")
            continue
        rate = rates.get(model, default_rate)
        predicted = (steps - done) * tps / rate + plan.get("overheads", {}).get(model, 60.0)
        left = deadline - time.monotonic() - s["reserve_s"]
        if model in plan["extra"] and predicted * 1.1 > left:
            say(f"{model}: skipped, {predicted:.0f}s needed and {left:.0f}s left")
            continue
        if left < 30:
            say(f"{model}: skipped, {left:.0f}s left")
            continue
        limit = min(left, s["model_limit_s"] or predicted * 1.3 + 60)
        interval = max(10, round(s["checkpoint_s"] * rate / tps))
        extra = [
            "train.log_interval=10",
            f"train.eval_interval={max(1, steps // 8)}",
            f"train.checkpoint_interval={interval}",
        ]
        say(
            f"{model}: steps {done} -> {steps} ({steps * tps:,} tokens), about {predicted:.0f}s, stopped after "
            f"{limit:.0f}s; a checkpoint every {interval} steps"
        )
        env, sets = FALLBACKS[fallbacks.get(model, extra_fallback)]
        command = train_command(s, model, steps, [*extra, *sets])
        code, wall, stopped = run_training(command, limit, f"[{model}]", grace(s), env)
        reached = latest_step(run)
        rate_now = measured_rate(run, done + min(10, (reached - done) // 2))
        say(
            f"stage train {model}: {wall:.1f}s, exit {code}, step {reached}/{steps}"
            + (f", {rate_now:,.0f} tokens/s" if rate_now else "")
            + (" (cut off by the time limit: resumable)" if stopped and reached < steps else "")
        )
        if code not in (0, 130):
            status = code
        # what is done so far comes back even if the call is cut short later (packed again at the end)
        began = time.monotonic()
        try:
            pack(out, s)
        except Exception as exc:  # the final pack tries again
            say(f"packing after {model} failed: {exc!r}")
        say(f"stage pack after {model}: {time.monotonic() - began:.1f}s")
    return status


# ---- packing what comes back ------------------------------------------------------------------


def _bf16_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


def encode_bf16(data: bytes) -> bytes:
    """bf16 bytes -> the deflated high bytes (sign, exponent, a mantissa bit) then the low bytes as they are."""
    raw = np.frombuffer(data, dtype=np.uint8)
    high = zlib.compress(raw[1::2].tobytes(), 6)
    return len(high).to_bytes(8, "little") + high + raw[0::2].tobytes()


def decode_bf16(blob: bytes, count: int) -> bytes:
    size = int.from_bytes(blob[:8], "little")
    high = np.frombuffer(zlib.decompress(blob[8 : 8 + size]), dtype=np.uint8)
    low = np.frombuffer(blob[8 + size :], dtype=np.uint8)
    if len(high) != count or len(low) != count:
        raise ValueError("a bf16 tensor's bytes do not match its shape")
    out = np.empty(2 * count, dtype=np.uint8)
    out[0::2], out[1::2] = low, high
    return out.tobytes()


def encode_moment(tensor: Any, root: bool) -> bytes:
    """An AdamW moment as float8_e4m3fn with an fp32 scale per BLOCK elements; exp_avg_sq (root)
    as its square root, so the 8-bit float's relative error halves on the way back."""
    import torch

    flat = tensor.detach().float().reshape(-1)
    if root:
        flat = flat.clamp_min(0).sqrt()
    blocks = math.ceil(flat.numel() / BLOCK) if flat.numel() else 0
    padded = torch.zeros(blocks * BLOCK)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, BLOCK)
    scale = padded.abs().amax(1).clamp_min(1e-30) / FP8_MAX
    quantized = (padded / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return scale.numpy().astype("<f4").tobytes() + quantized.numpy().tobytes()


def decode_moment(blob: bytes, shape: list[int], root: bool) -> Any:
    import torch

    count = math.prod(shape)
    blocks = math.ceil(count / BLOCK) if count else 0
    scale = torch.from_numpy(np.frombuffer(blob[: 4 * blocks], dtype="<f4").copy())
    quantized = torch.from_numpy(np.frombuffer(blob[4 * blocks :], dtype=np.uint8).copy())
    values = quantized.view(torch.float8_e4m3fn).float().view(blocks, BLOCK) * scale[:, None]
    if root:
        # a root rounded to zero would divide an update by eps: keep it at the block's smallest step
        values = torch.where(values > 0, values, scale[:, None] * 2.0**-9).square()
    return values.reshape(-1)[:count].reshape(shape).contiguous()


def _moment_keys(encoded: Any, found: dict[str, str], name: str | None = None) -> None:
    """{tensor key: moment name} of the AdamW moments in a checkpoint's encoded trainer state."""
    if isinstance(encoded, dict):
        if "__tensor__" in encoded and name in MOMENTS:
            found[encoded["__tensor__"]] = name
        for key, value in encoded.items():
            _moment_keys(value, found, key)
    elif isinstance(encoded, list):
        for value in encoded:
            _moment_keys(value, found, name)


class Payload:
    """Items (a model's weights, a cut-off run's moments) laid back to back, cut into parts."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buffer = io.BytesIO()
        self.items: list[dict[str, Any]] = []
        self.left_out: list[str] = []

    def add(self, item: dict[str, Any], blobs: list[tuple[dict[str, Any], bytes]]) -> bool:
        size = sum(len(blob) for _, blob in blobs)
        if self.buffer.tell() + size > self.budget:
            self.left_out.append(f"{item['model']} {item['kind']} ({size / 1e6:.1f} MB)")
            return False
        item = {**item, "offset": self.buffer.tell(), "bytes": size, "tensors": []}
        digest = hashlib.sha256()
        for entry, blob in blobs:
            item["tensors"].append({**entry, "offset": self.buffer.tell(), "bytes": len(blob)})
            self.buffer.write(blob)
            digest.update(blob)
        item["sha256"] = digest.hexdigest()
        self.items.append(item)
        return True


def pack(out: Path, s: dict[str, Any] | None = None) -> None:
    """Write LOG_FILE's companions into `out`: runs.tar.xz (plan, configs, metrics, the newest
    checkpoint's small files), payload.partNN (weights; a cut-off run's moments) and pack.json
    (what each part and item holds, with SHA-256), within RETURN_FILES files and RETURN_BYTES."""
    import torch
    from safetensors.torch import load_file

    s = s or settings()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("payload.part*"):
        old.unlink()
    runs = s["runs"]
    plan = json.loads((runs / PLAN_FILE).read_text()) if (runs / PLAN_FILE).exists() else {}
    models = [m for m in [*s["models"], *s["extra"]] if latest_step(runs / m) > 0]
    small = io.BytesIO()
    record: dict[str, Any] = {"plan": plan, "models": {}, "runs": str(runs)}
    blobs_of: dict[str, list] = {}
    with lzma.open(small, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:

        def add(name: str, data: bytes) -> None:
            tar.addfile(_tar_info(name, len(data)), io.BytesIO(data))

        if (runs / PLAN_FILE).exists():
            add(PLAN_FILE, (runs / PLAN_FILE).read_bytes())
        for model in models:
            run = runs / model
            step = latest_step(run)
            ckpt = run / "checkpoints" / f"step_{step:08d}"
            finished = bool(plan) and step >= plan["steps"]
            for name in ("config.yaml", "metrics.jsonl"):
                if (run / name).exists():
                    add(f"{model}/{name}", (run / name).read_bytes())
            for file in sorted(ckpt.iterdir()):
                if file.name not in ("model.safetensors", "trainer_state.safetensors"):
                    add(f"{model}/checkpoints/{ckpt.name}/{file.name}", file.read_bytes())
            weights = load_file(ckpt / "model.safetensors")
            entries = []
            for name, tensor in weights.items():
                data = _bf16_bytes(tensor)
                entry = {
                    "name": name,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype)[6:],
                    "bf16": sha256_bytes(data),
                }
                entries.append((entry, encode_bf16(data)))
            blobs_of[f"{model} weights"] = entries
            moments = []
            if not finished and (ckpt / "trainer_state.safetensors").exists():
                encoded = json.loads((ckpt / "trainer_state.json").read_text())
                state = load_file(ckpt / "trainer_state.safetensors")
                keys: dict[str, str] = {}
                _moment_keys(encoded, keys)
                rest = {k: v for k, v in state.items() if k not in keys}
                from safetensors.torch import save

                add(f"{model}/checkpoints/{ckpt.name}/trainer_state.rest.safetensors", save(rest))
                for key, name in sorted(keys.items(), key=lambda kv: int(kv[0])):
                    entry = {"key": key, "moment": name, "shape": list(state[key].shape)}
                    moments.append((entry, encode_moment(state[key], name == "exp_avg_sq")))
            blobs_of[f"{model} moments"] = moments
            params = sum(t.numel() for t in weights.values())
            record["models"][model] = {
                "step": step,
                "finished": finished,
                "checkpoint": ckpt.name,
                "parameters": params,
            }
    small_bytes = small.getvalue()
    (out / SMALL_FILE).write_bytes(small_bytes)
    log = out / LOG_FILE
    log_bytes = log.stat().st_size if log.exists() else 0
    # the log goes on growing a little after this; pack.json is a few KB
    budget = min(RETURN_BYTES - len(small_bytes) - log_bytes - (1 << 20), (RETURN_FILES - 3) * PART_BYTES)
    payload = Payload(budget)
    finished = [m for m in models if record["models"][m]["finished"]]
    for model in finished + [m for m in models if m not in finished]:
        if payload.add({"model": model, "kind": "weights", "encoding": "bf16-planes"}, blobs_of[f"{model} weights"]):
            if blobs_of[f"{model} moments"]:
                payload.add(
                    {"model": model, "kind": "moments", "encoding": "fp8-e4m3-block"}, blobs_of[f"{model} moments"]
                )
    data = payload.buffer.getvalue()
    parts = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        chunk = data[start : start + PART_BYTES]
        name = f"payload.part{index:02d}"
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": sha256_bytes(chunk)})
    record |= {
        "items": payload.items,
        "parts": parts,
        "payload_bytes": len(data),
        "left_out": payload.left_out,
        "small": {"name": SMALL_FILE, "bytes": len(small_bytes), "sha256": sha256_bytes(small_bytes)},
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    (out / PACK_FILE).write_text(json.dumps(record, indent=1) + "\n")
    for model, info in record["models"].items():
        kinds = [item["kind"] for item in payload.items if item["model"] == model]
        say(
            f"packed {model}: step {info['step']}, {'finished' if info['finished'] else 'cut off'}, {', '.join(kinds) or 'nothing'}"
        )
    if payload.left_out:
        say(f"left out (over the {RETURN_BYTES >> 20} MiB that come back): {'; '.join(payload.left_out)}")
    files = sorted(out.iterdir())
    total = sum(f.stat().st_size for f in files)
    say(f"{out}: {len(files)} files, {total / 2**20:.1f} MiB ({len(data) / 1e6:.1f} MB of weights and moments)")


# ---- back on the CPU: parts -> run directories ------------------------------------------------


def reassemble(source: Path, runs: Path) -> None:
    """The files `pack` wrote (in `source`) -> runs/MODEL, each a run directory whose newest
    checkpoint `farsight train` resumes (a cut-off run) or `load_model` / `train.init_from` read."""
    import torch
    from safetensors.torch import load, save_file

    from farsight.models.io import (
        CHECKSUMS_FILE,
        CONFIG_FILE,
        HF_SHIM_FILE,
        WEIGHTS_FILE,
        save_tensors,
        write_checksums,
    )

    record = json.loads((source / PACK_FILE).read_text())
    chunks = []
    for part in record["parts"]:
        data = (source / part["name"]).read_bytes()
        if len(data) != part["bytes"] or sha256_bytes(data) != part["sha256"]:
            sys.exit(f"error: {source / part['name']} does not match the size and SHA-256 {PACK_FILE} records")
        chunks.append(data)
    payload = b"".join(chunks)
    small = (source / SMALL_FILE).read_bytes()
    if sha256_bytes(small) != record["small"]["sha256"]:
        sys.exit(f"error: {source / SMALL_FILE} does not match its SHA-256 in {PACK_FILE}")
    for model in record["models"]:
        if (runs / model).exists():
            sys.exit(f"error: {runs / model} exists; move it away or reassemble into another folder")
    runs.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(small), mode="r:xz") as tar:
        for member in tar.getmembers():
            target = (runs / member.name).resolve()
            if not member.isfile() or runs.resolve() not in target.parents:
                sys.exit(f"error: {SMALL_FILE} holds {member.name!r}, outside the run folders")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    items = {(item["model"], item["kind"]): item for item in record["items"]}
    for model, info in record["models"].items():
        ckpt = runs / model / "checkpoints" / info["checkpoint"]
        item = items.get((model, "weights"))
        if item is None:
            shutil.rmtree(runs / model)
            print(f"{model}: its weights did not come back (left out: {record['left_out']}); nothing written")
            continue
        if sha256_bytes(payload[item["offset"] : item["offset"] + item["bytes"]]) != item["sha256"]:
            sys.exit(f"error: the weights of {model} do not match their SHA-256")
        tensors = {}
        for entry in item["tensors"]:
            count = math.prod(entry["shape"])
            data = decode_bf16(payload[entry["offset"] : entry["offset"] + entry["bytes"]], count)
            if sha256_bytes(data) != entry["bf16"]:
                sys.exit(f"error: {model}'s tensor {entry['name']} does not match its SHA-256")
            bf16 = torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16)
            tensors[entry["name"]] = bf16.reshape(entry["shape"]).to(getattr(torch, entry["dtype"]))
        save_tensors(tensors, ckpt / WEIGHTS_FILE)
        moments = items.get((model, "moments"))
        rest = ckpt / "trainer_state.rest.safetensors"
        resumable = moments is not None and rest.exists()
        if resumable:
            if sha256_bytes(payload[moments["offset"] : moments["offset"] + moments["bytes"]]) != moments["sha256"]:
                sys.exit(f"error: the moments of {model} do not match their SHA-256")
            state = load(rest.read_bytes())
            for entry in moments["tensors"]:
                blob = payload[entry["offset"] : entry["offset"] + entry["bytes"]]
                state[entry["key"]] = decode_moment(blob, entry["shape"], entry["moment"] == "exp_avg_sq")
            save_file(state, ckpt / "trainer_state.safetensors")
        rest.unlink(missing_ok=True)
        if not resumable:
            # weights only: a finished run (or one whose moments did not come back) keeps no trainer state
            (ckpt / "trainer_state.json").unlink(missing_ok=True)
        write_checksums(ckpt, (CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", HF_SHIM_FILE))
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(ckpt.iterdir())
            if p.is_file() and p.name != "manifest.json"
        }
        (ckpt / "manifest.json").write_text(json.dumps({"step": info["step"], "files": files}, indent=2))
        assert CHECKSUMS_FILE in files
        how = "resumable (bf16 weights, 8-bit moments)" if resumable else "weights (bf16, stored as fp32)"
        state = "finished" if info["finished"] else "cut off"
        print(f"{runs / model}: step {info['step']}, {state}, {how}; every part and tensor matched its SHA-256")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack-corpus")
    p.add_argument("tokens", type=Path)
    p.add_argument("archive", type=Path)
    p = sub.add_parser("unpack-corpus")
    p.add_argument("archive", type=Path)
    p.add_argument("tokens", type=Path)
    p = sub.add_parser("train")
    p.add_argument("out", type=Path)
    p = sub.add_parser("pack")
    p.add_argument("out", type=Path)
    p = sub.add_parser("reassemble")
    p.add_argument("source", type=Path)
    p.add_argument("runs", type=Path)
    args = parser.parse_args()
    if args.command == "pack-corpus":
        pack_corpus(args.tokens, args.archive)
    elif args.command == "unpack-corpus":
        unpack_corpus(args.archive, args.tokens, os.environ.get("CORPUS_SHA256"))
    elif args.command == "train":
        return train(args.out)
    elif args.command == "pack":
        pack(args.out)
    else:
        reassemble(args.source, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
