"""The public names a user imports, and op input errors as farsight's own one-line errors."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import farsight
from farsight.cli import main
from farsight.errors import FarsightError, InputError, InputTypeError

PACKAGE = Path(__file__).parents[1] / "farsight"


def test_top_level_names():
    from farsight import DRTConfig, DRTForCausalLM, TransformerConfig, TransformerForCausalLM, load_model
    from farsight.models import registry

    assert load_model is registry.load_model
    assert DRTForCausalLM.config_class is DRTConfig
    assert TransformerForCausalLM.config_class is TransformerConfig
    assert set(farsight.__all__) <= set(dir(farsight))
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        farsight.Missing  # noqa: B018


def test_importing_farsight_loads_no_model_code():
    code = "import sys, farsight; print(any(m.startswith('farsight.models') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ops_names_are_the_functions():
    import farsight.ops.gca.recompute as recompute_module
    from farsight.ops import castle_attention, gca, sliding_window_attention
    from farsight.ops.castle import castle_attention as castle_module_function
    from farsight.ops.gca import gca_reference

    assert castle_attention is castle_module_function and callable(sliding_window_attention)
    # farsight.ops.gca is the package (its modules import as usual) and, called, the op
    assert gca.gca_reference is gca_reference and recompute_module.gca_recompute is gca.gca_recompute
    q = torch.randn(1, 2, 3, 1, 4)
    k = v = torch.randn(1, 2, 2, 1, 4)
    index, weight = torch.tensor([[[-1], [0]]]), torch.ones(1, 2, 1)
    torch.testing.assert_close(gca(q, k, v, index, weight), gca.gca(q, k, v, index, weight, backend="reference"))


def test_the_gca_layer_lives_in_layers():
    from farsight.layers import GroupedCrossAttention

    layer = GroupedCrossAttention(d_model=8, n_heads=2, head_dim=4)
    x = torch.randn(1, 3, 5, 8)  # [B, n, S+1, d_model]
    k = v = torch.randn(1, 3, 4, 2, 4)  # [B, m, S, H, d]
    index = torch.tensor([[[-1], [0], [1]]])
    out = layer(x, k, v, index, torch.ones(1, 3, 1))
    assert out.shape == x.shape
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))  # no chunk retrieved: GCA adds zero


def test_op_input_errors_are_farsight_errors():
    from farsight.ops import castle_attention, gca, sliding_window_attention

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(InputError, match="window"):
        sliding_window_attention(q, q, q, 0)
    with pytest.raises(InputTypeError, match="floating-point"):
        castle_attention(*[q.long()] * 6)
    with pytest.raises(InputTypeError, match="torch.Tensor"):
        gca([1], q, q, q, q)
    # still the built-in types callers may catch
    with pytest.raises(ValueError):
        sliding_window_attention(q, q, q, 0)


def test_ops_and_layers_raise_only_farsight_errors():
    """Every `raise` of a built-in ValueError/TypeError/RuntimeError in ops/ and layers/ would
    reach the CLI as a traceback; they must raise farsight.errors types instead."""
    plain = {"ValueError", "TypeError", "RuntimeError"}
    found = []
    for path in [*PACKAGE.joinpath("ops").rglob("*.py"), *PACKAGE.joinpath("layers").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", None)
                if name in plain:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raises {name}")
    assert found == []


def test_a_bad_op_argument_through_the_cli_prints_one_line(monkeypatch, capsys):
    from farsight.cli import model as model_commands
    from farsight.ops import sliding_window_attention

    def generate_with_a_bad_window(args):
        q = torch.randn(1, 4, 1, 2)
        sliding_window_attention(q, q, q, window=-3)
        return 0

    monkeypatch.setattr(model_commands, "_generate", generate_with_a_bad_window)
    assert main(["generate", "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "window" in err
    assert issubclass(InputError, FarsightError)
