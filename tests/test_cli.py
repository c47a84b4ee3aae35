import logging
import subprocess
import sys
from pathlib import Path

import pytest

from farsight.cli import build_parser, main
from farsight.errors import InputError


def test_help_lists_every_command_without_loading_torch():
    code = (
        "import sys\n"
        "from farsight.cli import build_parser\n"
        "help_text = build_parser().format_help()\n"
        "assert 'torch' not in sys.modules, 'building the parser imported torch'\n"
        "print(help_text)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for command in ("data", "train", "generate", "export", "demo", "eval"):
        assert f"    {command} " in out


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "farsight.cli", "eval", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "passkey" in out and "bench" in out


def test_memory_choices_are_the_model_tiers(capsys):
    from farsight.models import MEMORY_TIERS

    for tier in MEMORY_TIERS:
        assert (
            build_parser().parse_args(["eval", "ppl", "--model", "m", "--corpus", "c", "--memory", tier]).memory == tier
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--memory", "nowhere"])
    assert "invalid choice: 'nowhere'" in capsys.readouterr().err


def test_user_errors_print_one_line_and_return_2(tmp_path, capsys):
    assert main(["data", "info", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "farsight data prepare" in err and len(err.strip().splitlines()) == 1
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trian", "x.yaml"], "invalid choice: 'trian' (choose from 'data', 'train', "),
        (["eval", "passkey", "--model", "m", "--dtype", "bfloat16"], "invalid choice: 'bfloat16'"),
        (["eval", "passkey", "--model", "m", "--lenghts", "1k"], "unrecognized arguments: --lenghts 1k"),
        (["eval", "passkey", "--trials", "3"], "the following arguments are required: --model"),
    ],
)
def test_usage_errors_are_one_line_naming_the_closest_choice_and_the_help(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err
    suggestion, help_of = {
        "trian": ("did you mean train?", "`farsight --help`"),
        "--dtype": ("did you mean bf16?", "`farsight eval passkey --help`"),
        "--lenghts": ("did you mean --lengths?", "`farsight eval passkey --help`"),
        "--trials": (None, "`farsight eval passkey --help`"),
    }[next(a for a in argv if a in ("trian", "--dtype", "--lenghts", "--trials"))]
    assert (suggestion is None or suggestion in err) and err.rstrip().endswith(f"see {help_of}")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, which refuses new files")
def test_an_output_in_a_folder_that_refuses_files_is_refused_before_any_work(monkeypatch, capsys):
    import farsight.cli.arguments

    loaded = []
    monkeypatch.setattr(farsight.cli.arguments, "load_model_and_tokenizer", lambda *a: loaded.append(a))
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    for flag, path in (("--out", "/proc/farsight-results.json"), ("--plot", "/proc/farsight-figure.png")):
        assert main(["eval", "passkey", "--model", model, "--lengths", "1k", flag, path]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {path} cannot be written: /proc refuses new files" in err and len(err.splitlines()) == 1
    assert loaded == []


def test_a_file_write_the_folder_refuses_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import os

    from farsight.errors import WriteError
    from farsight.files import atomic_write

    def refuse(path, flags, mode=0o777):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(WriteError, match=r"cannot write .*out.json \(Permission denied\); check the permissions"):
        atomic_write(tmp_path / "out.json", lambda tmp: None)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_an_error_inside_a_loop_closes_its_progress_bar_before_the_message(capsys):
    import io

    from farsight.progress import close_progress_bars, progress_bar

    stream = io.StringIO()
    bar = progress_bar(total=3, file=stream)
    bar.update(1)
    close_progress_bars()
    assert bar.disable and stream.getvalue().endswith("\n")  # closed: the line ends, no redraw follows


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["eval", "passkey", "--filler", "repeat", "--corpus", "elsewhere"],
            "--corpus has no effect with --filler repeat (no corpus text); drop it",
        ),
        (
            ["eval", "passkey", "--export-choice", "{tmp}/tasks", "--out", "{tmp}/r.json", "--plot", "{tmp}/p.png"],
            "--out and --plot have no effect with --export-choice, which writes lm-eval tasks instead of evaluating",
        ),
        (
            ["eval", "ruler", "--tasks", "niah_single_1", "--haystack", "noise", "--split", "train"],
            "--split has no effect with --haystack noise",
        ),
        (
            ["eval", "ruler", "--export", "{tmp}/tasks", "--memory", "disk"],
            "--memory has no effect with --export",
        ),
        (
            ["eval", "retrieval", "--text", "README.md", "--document", "3"],
            "--document has no effect with --text (they pick a document of --corpus); drop it",
        ),
    ],
)
def test_options_the_chosen_mode_does_not_read_are_refused(argv, message, tmp_path, capsys):
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    argv = [a.format(tmp=tmp_path) for a in argv[:2]] + ["--model", model] + [a.format(tmp=tmp_path) for a in argv[2:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "passkey", "--lengths", "1k", "--memory", "disk"],
        ["eval", "ppl", "--corpus", "elsewhere", "--kv-dtype", "bf16"],
        ["eval", "generate", "--data", "README.md", "--memory", "host"],
    ],
)
def test_memory_tiers_are_refused_for_a_model_without_chunk_memory(argv, capsys):
    model = str(Path(__file__).resolve().parents[1] / "models" / "base-baselm-2l")  # a sliding-window transformer
    assert main([*argv[:2], "--model", model, *argv[2:]]) == 2
    err = capsys.readouterr().err
    assert "--memory and --kv-dtype choose where a DRT keeps its chunk memory" in err and "drop them" in err
    assert len(err.splitlines()) == 1


def test_a_value_listed_twice_is_refused(capsys):
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    assert main(["eval", "passkey", "--model", model, "--lengths", "1k,1024"]) == 2
    assert capsys.readouterr().err == "error: --lengths='1k,1024' lists 1024 twice; list each once\n"
    assert main(["eval", "passkey", "--model", model, "--depths", "0.5,0.5"]) == 2
    assert "--depths='0.5,0.5' lists 0.5 twice" in capsys.readouterr().err


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    same = str(tmp_path / "x.png")
    assert main(["eval", "passkey", "--model", model, "--lengths", "1k", "--out", same, "--plot", same]) == 2
    assert capsys.readouterr().err == f"error: --out and --plot name the same file {same}; give each its own path\n"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_text_path_is_named(capsys):
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    assert main(["eval", "retrieval", "--model", model, "--text", ""]) == 2
    assert capsys.readouterr().err == "error: --text is empty; pass a text file\n"


def test_a_dataset_file_given_for_its_folder_names_the_folder(tmp_path, capsys):
    data = Path(__file__).resolve().parents[1] / "data" / "lm-byte"
    (tmp_path / "notes.txt").write_text("x")
    assert main(["data", "info", str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt is a file, not a prepared dataset; pass the folder" in capsys.readouterr().err
    if (data / "train.bin").is_file():  # a dataset `make data` prepares
        assert main(["data", "info", str(data / "train.bin")]) == 2
        assert f"train.bin is a file; a prepared dataset is its folder: pass {data}" in capsys.readouterr().err


def test_the_commands_messages_reach_the_terminal_once(tmp_path, capsys):
    """A root handler that an imported library sets up (logging.basicConfig) does not print the
    command's notes a second time."""
    import logging

    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        assert main(["data", "info", str(tmp_path / "nothing")]) == 2
        seen = []
        handler.emit = seen.append
        logging.getLogger("farsight.data").warning("note: once")
    finally:
        root.removeHandler(handler)
    assert seen == [] and capsys.readouterr().err.count("note: once") == 1


def test_traceback_flag_reraises_user_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--traceback", "train", str(tmp_path / "missing.yaml")])


def test_other_exceptions_are_bugs_and_keep_their_traceback(monkeypatch):
    import farsight.data.token_files

    def broken(path):
        raise KeyError("a bug")

    monkeypatch.setattr(farsight.data.token_files, "load_meta", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["data", "info", "x"])


def test_bad_list_arguments_are_input_errors():
    from farsight.cli.arguments import parse_list

    assert parse_list("1,2, 3", int, "--chunks", "chunk numbers") == [1, 2, 3]
    with pytest.raises(InputError, match=r"--depths='0,x' is not a comma-separated list of numbers"):
        parse_list("0,x", float, "--depths", "numbers")


def test_every_command_runs_under_farsights_malloc_settings(monkeypatch, tmp_path):
    import farsight.cli

    calls = []
    monkeypatch.setattr(farsight.cli, "tune_malloc", lambda: calls.append("tuned"))
    assert main(["data", "info", str(tmp_path / "nothing")]) == 2
    assert calls == ["tuned"]


@pytest.mark.parametrize(
    "native, dtype, noted", [(False, "bf16", True), (True, "bf16", False), (False, "fp32", False), (True, "fp16", True)]
)
def test_a_dtype_this_cpu_emulates_gets_a_note(native, dtype, noted, monkeypatch, farsight_log):
    import torch

    from farsight.cli.arguments import load_model_and_tokenizer
    from farsight.ops import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(
        precision, "cpu_has_native_fp16", lambda: False
    )  # a CPU with bf16 instructions may lack fp16 ones
    model, _ = load_model_and_tokenizer(str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt"), dtype)
    assert (
        next(model.parameters()).dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    )
    warned = [r.getMessage() for r in farsight_log.records if r.levelno >= logging.WARNING]
    assert (
        any(f"--dtype {dtype} runs its matrix products as fp32 GEMMs, no faster than --dtype fp32" in m for m in warned)
        == noted
    )
    assert len(warned) == int(noted)


@pytest.mark.parametrize("native", [False, True])
def test_a_bf16_command_widens_the_products_this_cpu_lacks(native, monkeypatch, capsys, widened_ops):
    from farsight.ops import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    model = str(Path(__file__).resolve().parents[1] / "models" / "passkey-drt")
    assert (
        main(["generate", "--model", model, "--prompt", "def f(x):", "--max-new-tokens", "3", "--dtype", "bf16"]) == 0
    )
    assert bool(widened_ops) != native
    widened_ops.clear()
    assert main(["generate", "--model", model, "--prompt", "def f(x):", "--max-new-tokens", "3"]) == 0  # fp32
    assert not widened_ops


def test_output_cut_short_by_its_reader_is_no_error(tmp_path):
    """`farsight ... | head`: the reader closes the pipe; no traceback, the shell's SIGPIPE status."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text("some text " * 50)
    data = tmp_path / "data"
    assert main(["data", "prepare", "-q", "--source", str(docs), "--tokenizer", "byte", "--out", str(data)]) == 0
    script = "import sys; from farsight.cli import main; sys.exit(main(['data', 'info', sys.argv[1]]))"
    proc = subprocess.Popen([sys.executable, "-c", script, str(data)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `head` does once it has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
