"""Untrusted model files and failing sessions, one table: each case builds what it acts on
(setup), makes one call or command, expects one farsight error of one line (or success), and
checks what must not be lost or run. Adding a case is one line of CASES."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from farsight.cli import main
from farsight.config import ConfigError
from farsight.data.tokenizers import ByteTokenizer
from farsight.errors import ModelFileError, StateError
from farsight.models import (
    DRTConfig,
    DRTForCausalLM,
    TransformerConfig,
    TransformerForCausalLM,
    build_model,
    load_model,
)
from farsight.models.chunk_memory import DiskMemoryError, FileStore, _TempFiles

TOK = ByteTokenizer()
TINY = dict(d_model=32, n_layers=4, n_heads=2, chunk_size=5, window=12, top_k=2, encoder_layers=1)
Ctx = dict[str, Any]


def drt(**kw: Any) -> DRTForCausalLM:
    torch.manual_seed(0)
    return DRTForCausalLM(DRTConfig(**{**TINY, "vocab_size": 40, **kw})).eval()


# ---- model directories ------------------------------------------------------------------------
def saved(tmp: Path, poison: str | None = None) -> Ctx:
    """A DRT model directory with tokenizer; `poison` puts a NaN/inf into embed.weight first."""
    model = build_model({"type": "drt", **TINY}, tokenizer=TOK)
    if poison:
        with torch.no_grad():
            model.embed.weight[3, 1] = float(poison)
    path = model.save_pretrained(tmp / "m", tokenizer=TOK)
    return {"path": path, "files": {p.name: p.read_bytes() for p in path.iterdir()}}


def damaged(change: Callable[[Path], None]) -> Callable[[Path], Ctx]:
    def setup(tmp: Path) -> Ctx:
        ctx = saved(tmp)
        change(ctx["path"])
        return ctx

    return setup


def flip_tensor_byte(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-7] ^= 0x10  # inside the last tensor's data: safetensors itself still parses it
    (path / "model.safetensors").write_bytes(bytes(data))


def edit_config(path: Path) -> None:
    text = (path / "config.json").read_text()
    assert '"top_k": 2,' in text
    (path / "config.json").write_text(text.replace('"top_k": 2,', '"top_k": 3,'))  # valid JSON, same size


def truncate_weights(path: Path) -> None:
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:100])


def drop_record(path: Path) -> None:
    (path / "checksums.json").unlink()


def load(ctx: Ctx) -> Any:
    return load_model(ctx["path"])


def gpt2_tokenizer(path: Path) -> None:
    """GPT-2's tokenizer.json (50,259 tokens) in place of the model's, checksums.json gone with it."""
    from farsight.data.tokenizers import load_tokenizer

    load_tokenizer("gpt2").save(path)
    drop_record(path)


def hf_tokenizer(ctx: Ctx) -> Any:
    from farsight.hf import FarsightTokenizerFast

    return FarsightTokenizerFast.from_pretrained(ctx["path"])


def hf_model(ctx: Ctx) -> Any:
    from farsight.hf import FarsightForCausalLM

    return FarsightForCausalLM.from_pretrained(ctx["path"])


def lm_eval_model(ctx: Ctx) -> Any:
    pytest.importorskip("lm_eval")
    from farsight.hf.harness import FarsightLM

    return FarsightLM(str(ctx["path"]))


FOREIGN_TOKENIZER = r"tokenizer\.json has 50,259 tokens but the model in .* has a vocabulary of 260: the tokenizer belongs to another model"


def without_record(call: Callable[[Ctx], Any]) -> Callable[[Ctx], None]:
    def warned(ctx: Ctx) -> None:
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("farsight.models.io")
        logger.addHandler(handler)
        try:
            call(ctx)
        finally:
            logger.removeHandler(handler)
        assert any("has no checksums.json" in r.getMessage() and r.levelno == logging.WARNING for r in records)

    return warned


def cli(*argv: str) -> Callable[[Ctx], int]:
    """A farsight command; {path} and {out} stand for the model directory and tmp/out."""

    def call(ctx: Ctx) -> int:
        args = [a.format(path=ctx["path"], out=ctx["tmp"] / "out") for a in argv]
        assert main(["--traceback", *args]) == 0
        return 0

    return call


def files_untouched(ctx: Ctx) -> None:
    """The damaged directory is left as it was (nothing repaired, deleted or rewritten)."""
    assert {p.name: p.read_bytes() for p in ctx["path"].iterdir()} == ctx["after_setup"]


def nothing_exported(ctx: Ctx) -> None:
    files_untouched(ctx)
    assert not (ctx["tmp"] / "out").exists()


def export_writes_a_record(ctx: Ctx) -> None:
    files_untouched(ctx)
    assert sorted(os.listdir(ctx["tmp"] / "out")) == [
        "checksums.json",
        "config.json",
        "farsight_hf.py",
        "model.safetensors",
        "tokenizer.json",
    ]
    load_model(ctx["tmp"] / "out")


def export_keeps_the_record(ctx: Ctx) -> None:
    """The export records the same files, sizes and hashes, and marks itself as an export."""
    out = ctx["tmp"] / "out"
    record = json.loads((out / "checksums.json").read_text())
    assert record["files"] == json.loads(ctx["files"]["checksums.json"])["files"]
    assert record["written_by"] == "farsight export"
    load_model(out)


# ---- session transactions ---------------------------------------------------------------------
def failing_append(session: Any, after_chunks: int) -> dict[str, Any]:
    """Wrap the store's append: chunks beyond the first `after_chunks` fail like a full disk."""
    store, real = session.memory.store, session.memory.store.append
    fault = {"on": True, "stored": session.memory.n_chunks}

    def append(k: torch.Tensor, v: torch.Tensor) -> None:
        if fault["on"] and fault["stored"] + k.shape[1] > after_chunks:
            raise DiskMemoryError(errno.ENOSPC, "No space left on device (injected)")
        real(k, v)
        fault["stored"] += k.shape[1]

    store.append = append
    return fault


def failing_pwrite(session: Any, after_chunks: int) -> dict[str, Any]:
    """The disk tier's own write fails with ENOSPC (a partial record) once `after_chunks` are stored."""
    store, real = session.memory.store, os.pwrite
    fault = {"on": True}

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if fault["on"] and fd == store._fd and offset + len(data) > after_chunks * store._record:
            real(fd, data[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    os.pwrite = pwrite
    fault["cleanup"] = lambda: setattr(os, "pwrite", real)
    return fault


def stream(
    memory: str, inject: Callable[[Any, int], dict[str, Any]] = failing_append, feed: bool = False
) -> Callable[[Path], Ctx]:
    """A DRT session (record_retrieval, 1 chunk per span) fed 17 tokens; the next 40 tokens
    (8 chunks, 8 spans) fail at their 4th chunk."""

    def setup(tmp: Path) -> Ctx:
        model, x = drt(), torch.randint(0, 36, (2, 57), generator=torch.Generator().manual_seed(1))
        options = dict(batch_size=2, memory=memory, segment_chunks=1, record_retrieval=True)
        with model.new_session(**options) as clean:
            clean.prefill(x[:, :17])
            want = clean.feed(x[:, 17:]) if feed else clean.prefill(x[:, 17:])
            want_next = clean.step(x[:, 0])
            records = clean.retrievals
        session = model.new_session(**options)
        session.prefill(x[:, :17])
        fault = inject(session, session.memory.n_chunks + 3)

        def cleanup() -> None:
            fault.get("cleanup", lambda: None)()
            session.close()

        return {
            "session": session,
            "x": x,
            "want": want,
            "want_next": want_next,
            "records": records,
            "feed": feed,
            "fault": fault,
            "cleanup": cleanup,
        }

    return setup


def feed_block(ctx: Ctx) -> Any:
    session, block = ctx["session"], ctx["x"][:, 17:]
    return session.feed(block) if ctx["feed"] else session.prefill(block)


def retry_equals_uninterrupted(ctx: Ctx) -> None:
    session, fault = ctx["session"], ctx["fault"]
    assert session.tokens_seen == 17
    fault["on"] = False
    torch.testing.assert_close(feed_block(ctx), ctx["want"], rtol=0, atol=0)
    torch.testing.assert_close(session.step(ctx["x"][:, 0]), ctx["want_next"], rtol=0, atol=0)
    for got, want in zip(
        (session.retrievals.indices, session.retrievals.weights), (ctx["records"].indices, ctx["records"].weights)
    ):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))  # nothing recorded twice


def transformer_failing_midway(tmp: Path) -> Ctx:
    model = TransformerForCausalLM(TransformerConfig(vocab_size=40, d_model=32, n_heads=2, n_layers=2))
    session = model.new_session(block=4)
    session.prefill(torch.arange(6))
    real, calls = model.blocks[1].forward, []

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory (injected)")
        return real(*args, **kwargs)

    model.blocks[1].forward = forward
    with pytest.raises(MemoryError):
        session.prefill(torch.arange(10))
    return {"session": session}


# ---- disk-tier files ----------------------------------------------------------------------------
def existing_file(tmp: Path) -> Ctx:
    (tmp / "notes.txt").write_text("precious")
    return {"target": tmp / "notes.txt"}


def symlink_to_file(tmp: Path) -> Ctx:
    (tmp / "notes.txt").write_text("precious")
    (tmp / "kv.bin").symlink_to(tmp / "notes.txt")
    return {"target": tmp / "notes.txt", "path": tmp / "kv.bin"}


def open_disk(overwrite: bool = False) -> Callable[[Ctx], None]:
    def call(ctx: Ctx) -> None:
        with drt().new_session(memory="disk", path=ctx.get("path", ctx["target"]), overwrite=overwrite) as session:
            session.prefill(torch.arange(12))

    return call


def target_kept(ctx: Ctx) -> None:
    assert ctx["target"].read_text() == "precious"


def nothing(tmp: Path) -> Ctx:
    return {}


def default_file_removed_on_close(ctx: Ctx) -> None:
    session = drt().new_session(memory="disk")
    path = session.memory.store.path
    session.prefill(torch.arange(12))
    assert path.is_file() and path.parent == _TempFiles.folder() and f"chunks-{os.getpid()}-" in path.name
    session.close()
    assert not path.exists()


CHILD = textwrap.dedent(
    """
    import signal, sys, time, torch
    from farsight.models import DRTConfig, DRTForCausalLM
    if sys.argv[1] == "handler":
        signal.signal(signal.SIGTERM, lambda *_: (print("own handler ran", flush=True), sys.exit(3)))
    model = DRTForCausalLM(DRTConfig(vocab_size=40, d_model=32, n_layers=4, n_heads=2, chunk_size=5, window=12, encoder_layers=1))
    session = model.new_session(memory="disk")
    session.prefill(torch.arange(12))
    print(session.memory.store.path, flush=True)
    time.sleep(60)
    """
)


def killed_child(sig: int, mode: str = "plain") -> Callable[[Ctx], None]:
    def call(ctx: Ctx) -> None:
        child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
        ctx["file"] = Path(child.stdout.readline().strip())
        assert ctx["file"].is_file()
        child.send_signal(sig)
        ctx["rc"], ctx["out"] = child.wait(30), child.stdout.read()

    return call


def sigterm_removed_file(ctx: Ctx) -> None:
    assert not ctx["file"].exists() and ctx["rc"] == -signal.SIGTERM


def sigterm_chained_handler(ctx: Ctx) -> None:
    assert not ctx["file"].exists() and ctx["rc"] == 3 and "own handler ran" in ctx["out"]


def orphan_removed_at_next_start(ctx: Ctx) -> None:
    assert ctx["file"].exists() and ctx["rc"] == -signal.SIGKILL  # SIGKILL cannot be caught
    live = _TempFiles.folder() / f"chunks-{os.getpid()}-keep.kv"  # a running process's file stays
    live.write_bytes(b"")
    FileStore(torch.device("cpu")).close()
    assert not ctx["file"].exists() and live.exists()
    live.unlink()


# ---- DRT config ---------------------------------------------------------------------------------
def build_with_landmark(name: str) -> Callable[[Ctx], Any]:
    return lambda ctx: build_model({"type": "drt", **TINY, "landmark_id": getattr(TOK, f"{name}_id")}, tokenizer=TOK)


@dataclass
class Case:
    name: str
    setup: Callable[[Path], Ctx]  # builds what the call acts on
    call: Callable[[Ctx], Any]  # the call or command
    error: tuple[type[Exception], str] | None  # (type, pattern of its one-line message); None: it succeeds
    keeps: Callable[[Ctx], None] | None = None  # checks what must not be lost or run


CASES = [
    Case(
        "flipped tensor bytes",
        damaged(flip_tensor_byte),
        load,
        (ModelFileError, r"model\.safetensors does not match its SHA-256"),
        files_untouched,
    ),
    Case(
        "NaN weight",
        lambda tmp: saved(tmp, "nan"),
        load,
        (ModelFileError, r"tensor 'embed\.weight' holds NaN or inf"),
        files_untouched,
    ),
    Case(
        "inf weight",
        lambda tmp: saved(tmp, "inf"),
        load,
        (ModelFileError, r"tensor 'embed\.weight' holds NaN or inf"),
        files_untouched,
    ),
    Case(
        "edited config.json",
        damaged(edit_config),
        load,
        (ModelFileError, r"config\.json does not match its SHA-256"),
        files_untouched,
    ),
    Case(
        "missing weights",
        damaged(lambda p: (p / "model.safetensors").unlink()),
        load,
        (ModelFileError, r"model\.safetensors is missing"),
        files_untouched,
    ),
    Case(
        "missing tokenizer.json",
        damaged(lambda p: (p / "tokenizer.json").unlink()),
        load,
        (ModelFileError, r"tokenizer\.json is missing"),
        files_untouched,
    ),
    Case(
        "truncated weights",
        damaged(truncate_weights),
        load,
        (ModelFileError, r"truncated or corrupted"),
        files_untouched,
    ),
    Case(
        "garbled checksums.json",
        damaged(lambda p: (p / "checksums.json").write_text("{")),
        load,
        (ModelFileError, r"checksums\.json is corrupted"),
        files_untouched,
    ),
    Case("no record (older farsight) loads, warns", damaged(drop_record), without_record(load), None, files_untouched),
    Case(
        "generate with another model's tokenizer",
        damaged(gpt2_tokenizer),
        cli("generate", "--model", "{path}", "--max-new-tokens", "2"),
        (ModelFileError, FOREIGN_TOKENIZER),
        files_untouched,
    ),
    Case(
        "farsight.hf tokenizer: another model's",
        damaged(gpt2_tokenizer),
        hf_tokenizer,
        (ModelFileError, FOREIGN_TOKENIZER),
        files_untouched,
    ),
    Case(
        "farsight.hf model: another model's tokenizer",
        damaged(gpt2_tokenizer),
        hf_model,
        (ModelFileError, FOREIGN_TOKENIZER),
        files_untouched,
    ),
    Case(
        "lm-eval model: another model's tokenizer",
        damaged(gpt2_tokenizer),
        lm_eval_model,
        (ModelFileError, FOREIGN_TOKENIZER),
        files_untouched,
    ),
    Case(
        "generate from flipped bytes",
        damaged(flip_tensor_byte),
        cli("generate", "--model", "{path}", "--max-new-tokens", "2"),
        (ModelFileError, r"does not match its SHA-256"),
        files_untouched,
    ),
    Case(
        "export of flipped bytes",
        damaged(flip_tensor_byte),
        cli("export", "{path}", "{out}"),
        (ModelFileError, r"does not match its SHA-256"),
        nothing_exported,
    ),
    Case(
        "export of a NaN weight",
        lambda tmp: saved(tmp, "nan"),
        cli("export", "{path}", "{out}"),
        (ModelFileError, r"holds NaN or inf"),
        nothing_exported,
    ),
    Case(
        "export of a good model keeps the record",
        saved,
        cli("export", "{path}", "{out}"),
        None,
        export_keeps_the_record,
    ),
    Case(
        "export of an older model (no record) adds one",
        damaged(drop_record),
        without_record(cli("export", "{path}", "{out}")),
        None,
        export_writes_a_record,
    ),
    Case(
        "device: append fails midway, retry",
        stream("device"),
        feed_block,
        (DiskMemoryError, r"injected"),
        retry_equals_uninterrupted,
    ),
    Case(
        "host: append fails midway, retry",
        stream("host"),
        feed_block,
        (DiskMemoryError, r"injected"),
        retry_equals_uninterrupted,
    ),
    Case(
        "disk: append fails midway, retry",
        stream("disk"),
        feed_block,
        (DiskMemoryError, r"injected"),
        retry_equals_uninterrupted,
    ),
    Case(
        "disk: ENOSPC in pwrite, retry feed",
        stream("disk", failing_pwrite, feed=True),
        feed_block,
        (DiskMemoryError, r"Free disk space"),
        retry_equals_uninterrupted,
    ),
    Case(
        "transformer failed midway: refuses",
        transformer_failing_midway,
        lambda ctx: ctx["session"].step(torch.tensor([1])),
        (StateError, r"failed midway \(MemoryError"),
        None,
    ),
    Case(
        "disk path exists",
        existing_file,
        open_disk(),
        (DiskMemoryError, r"already exists; .*overwrite=True"),
        target_kept,
    ),
    Case("disk path is a symlink", symlink_to_file, open_disk(), (DiskMemoryError, r"is a symlink"), target_kept),
    Case(
        "disk path is a symlink, overwrite=True",
        symlink_to_file,
        open_disk(overwrite=True),
        (DiskMemoryError, r"is a symlink"),
        target_kept,
    ),
    Case("disk path exists, overwrite=True", existing_file, open_disk(overwrite=True), None),
    Case("default disk file removed on close", nothing, default_file_removed_on_close, None),
    Case("default disk file removed on SIGTERM", nothing, killed_child(signal.SIGTERM), None, sigterm_removed_file),
    Case(
        "SIGTERM runs the handler before",
        nothing,
        killed_child(signal.SIGTERM, "handler"),
        None,
        sigterm_chained_handler,
    ),
    Case(
        "SIGKILLed file removed at next start",
        nothing,
        killed_child(signal.SIGKILL),
        None,
        orphan_removed_at_next_start,
    ),
    Case(
        "landmark id = eos",
        nothing,
        build_with_landmark("eos"),
        (ConfigError, r"landmark_id=258 is the tokenizer's eos id"),
        None,
    ),
    Case(
        "landmark id = bos",
        nothing,
        build_with_landmark("bos"),
        (ConfigError, r"landmark_id=257 is the tokenizer's bos id"),
        None,
    ),
    Case(
        "landmark id = pad",
        nothing,
        build_with_landmark("pad"),
        (ConfigError, r"landmark_id=256 is the tokenizer's pad id"),
        None,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_untrusted_model_case(case: Case, tmp_path: Path) -> None:
    ctx = case.setup(tmp_path)
    ctx["tmp"] = tmp_path
    if ctx.get("path") is not None and ctx["path"].is_dir():
        ctx["after_setup"] = {p.name: p.read_bytes() for p in ctx["path"].iterdir()}
    try:
        if case.error is None:
            case.call(ctx)
        else:
            kind, message = case.error
            with pytest.raises(kind, match=message) as raised:
                case.call(ctx)
            assert "\n" not in str(raised.value)
        if case.keeps is not None:
            case.keeps(ctx)
    finally:
        ctx.get("cleanup", lambda: None)()
