import json

import pytest

from farsight.cli import main
from farsight.errors import InputError, MissingFileError
from farsight.eval.plots import held_out_gaps, loss_curve_points
from farsight.eval.runs import architecture, summarize_run
from farsight.models import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM


def make_run(root, model, records, torn=False):
    model.save_pretrained(root / "checkpoints" / "step_00000040")
    lines = [json.dumps(r) for r in records]
    (root / "metrics.jsonl").write_text("\n".join(lines) + ('\n{"step": 6' if torn else "\n"))
    return root


RECORDS = [  # trained on a GPU, resumed on a CPU at step 20
    {
        "step": 20,
        "loss": 3.0,
        "tokens": 2000,
        "tokens_per_s": 1000.0,
        "precision": "bf16-mixed",
        "device": "NVIDIA H100",
    },
    {"step": 20, "val_loss": 3.2},
    {"step": 40, "loss": 2.5, "tokens": 4000, "tokens_per_s": 500.0, "precision": "bf16-mixed", "device": "cpu"},
    {"step": 40, "val_loss": 2.7},
]


def test_summary_reads_the_model_and_the_training_record(tmp_path):
    model = TransformerForCausalLM(
        TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, attention="sliding", window=16)
    )
    row = summarize_run(make_run(tmp_path, model, RECORDS, torn=True))
    assert row["parameters"] == model.num_parameters() and row["architecture"] == "sliding 16, alibi, 2 layers"
    assert (row["steps"], row["tokens"], row["train_loss"], row["val_loss"]) == (40, 4000, 2.5, 2.7)
    # 2000 tokens at 1000/s, then 2000 at 500/s: 6 s in all
    assert row["train_hours"] == pytest.approx(6 / 3600) and row["tokens_per_s"] == pytest.approx(4000 / 6)
    assert row["device"] == "NVIDIA H100, cpu"


def test_a_drt_ablation_is_named_in_its_architecture():
    base = dict(vocab_size=260, d_model=32, n_layers=4, n_heads=2, chunk_size=8, window=16, top_k=2, encoder_layers=1)
    assert architecture(DRTConfig(**base)) == "drt-x1, window 16, top-2, 4 layers"
    assert architecture(DRTConfig(**base, gumbel=False)) == "drt-x1, window 16, top-2, no Gumbel, 4 layers"
    assert architecture(DRTConfig(**base, retriever="random")) == "drt-x1, window 16, top-2, random retriever, 4 layers"
    assert architecture(DRTConfig(**base, softmax_one=False)) == "drt-x1, window 16, top-2, plain softmax, 4 layers"
    assert architecture(DRTConfig(**base, retriever="none")) == "drt-x1, window 16, top-2, no retrieval, 4 layers"


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    drt = DRTForCausalLM(
        DRTConfig(
            vocab_size=260,
            d_model=32,
            n_layers=4,
            n_heads=2,
            chunk_size=8,
            window=16,
            top_k=2,
            groups=2,
            encoder_layers=1,
        )
    )
    run = make_run(tmp_path / "drt", drt, RECORDS)
    assert main(["eval", "runs", str(run), "--out", str(tmp_path / "runs.json")]) == 0
    out = capsys.readouterr().out
    assert "drt-x2, window 16, top-2, 4 layers" in out and "params (M)" in out
    assert json.loads((tmp_path / "runs.json").read_text())["runs"][0]["parameters"] == drt.num_parameters()


def test_missing_metrics_are_named(tmp_path):
    with pytest.raises(MissingFileError, match="metrics.jsonl does not exist"):
        summarize_run(tmp_path)
    assert main(["eval", "runs", str(tmp_path / "nothing")]) == 2


def test_loss_curve_points_smooth_the_train_loss_and_place_held_out_losses_by_tokens():
    points = loss_curve_points(RECORDS + [{"step": 60, "loss": 2.0, "tokens": 6000}], smooth=2)
    assert points["train_x"] == [0.002, 0.004, 0.006]
    assert points["train_y"] == [3.0, 2.75, 2.25]
    assert points["val_x"] == [0.002, 0.004] and points["val_y"] == [3.2, 2.7]
    assert loss_curve_points([{"step": 5, "val_loss": 1.0}])["val_x"] == []
    # a curriculum: 100 tokens per step to step 20, then 300
    varying = [
        {"step": 20, "loss": 3.0, "tokens": 2000},
        {"step": 10, "val_loss": 3.1},
        {"step": 40, "loss": 2.0, "tokens": 8000},
        {"step": 40, "val_loss": 2.1},
    ]
    assert loss_curve_points(varying)["val_x"] == [0.001, 0.008]


def test_cli_plots_loss_curves_and_checks_the_labels(tmp_path, capsys):
    model = TransformerForCausalLM(TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2))
    runs = [str(make_run(tmp_path / f"s{seed}", model, RECORDS)) for seed in range(2)]
    assert main(["eval", "runs", *runs, "--labels", "causal, causal", "--plot", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "runs", *runs, "--labels", "causal"]) == 2
    assert "--labels names 1 for 2 run directories" in capsys.readouterr().err
    assert main(["eval", "runs", *runs, "--labels", "causal, "]) == 2
    assert "has an empty name" in capsys.readouterr().err


def _with_val(losses, steps=(20, 40, 60)):
    records = [{"step": step, "loss": 3.0, "tokens": 100 * step} for step in steps]
    return records + [{"step": step, "val_loss": loss} for step, loss in zip(steps, losses)]


def test_held_out_gaps_pair_each_seed_with_the_reference_seed_in_the_same_order():
    runs = [
        ("causal", _with_val([3.0, 2.0, 1.5])),
        ("causal", _with_val([3.2, 2.2, 1.7])),
        ("castle", _with_val([2.9, 2.0, 1.4])),
        ("castle", _with_val([2.5, 1.8], steps=(30, 80))),  # between the reference's evaluations, then past them
    ]
    gaps = held_out_gaps(runs, "causal")
    assert [label for label, _, _ in gaps] == ["castle", "castle"]
    assert gaps[0][1] == [0.002, 0.004, 0.006] and gaps[0][2] == pytest.approx([-0.1, 0.0, -0.1])
    assert gaps[1][1] == [0.003] and gaps[1][2] == pytest.approx(
        [2.5 - 2.7]
    )  # step 80 is past the reference's last: left out
    single = held_out_gaps(
        [
            ("castle", _with_val([2.9, 2.0, 1.4])),
            ("causal", _with_val([3.0, 2.5, 1.5])),
            ("swl", _with_val([3.1, 2.5, 1.5])),
        ],
        "causal",
    )
    assert [(label, pytest.approx(ys)) for label, _, ys in single] == [
        ("castle", [-0.1, -0.5, -0.1]),
        ("swl", [0.1, 0.0, 0.0]),
    ]
    with pytest.raises(InputError, match="names no run"):
        held_out_gaps(runs, "swl")
    with pytest.raises(InputError, match="'causal' has 2 runs but 'swl' has 1; give each label as many runs"):
        held_out_gaps(runs + [("swl", _with_val([3.0, 2.0, 1.5]))], "causal")


def test_cli_plots_the_gap_to_a_reference_label(tmp_path, capsys):
    model = TransformerForCausalLM(TransformerConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2))
    runs = [
        str(make_run(tmp_path / name, model, _with_val(losses)))
        for name, losses in [("a", [3.0, 2.0, 1.5]), ("b", [2.9, 1.9, 1.45])]
    ]
    plot = tmp_path / "gap.png"
    assert (
        main(["eval", "runs", *runs, "--labels", "causal,castle", "--plot", str(plot), "--relative-to", "causal"]) == 0
    )
    assert plot.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    out = tmp_path / "runs.json"
    assert (
        main(
            [
                "eval",
                "runs",
                *runs,
                "--labels",
                "causal,castle",
                "--plot",
                str(plot),
                "--relative-to",
                "swl",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "--relative-to 'swl' names no run; use one of the labels ['causal', 'castle']" in captured.err
    assert captured.out == "" and not out.exists()  # nothing printed or written before the error
    assert main(["eval", "runs", *runs, "--relative-to", "a"]) == 2
    assert "--relative-to needs --plot" in capsys.readouterr().err
