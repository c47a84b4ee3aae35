"""Library code logs through `logging` and never writes to the terminal itself: only farsight/cli/ does."""

import ast
from pathlib import Path

import farsight

PACKAGE = Path(farsight.__file__).parent


def _terminal_writes(tree: ast.AST) -> list[int]:
    """Lines of print(...), sys.stdout/stderr.write(...) and tqdm.write(...) calls."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "print":
            lines.append(node.lineno)
        elif isinstance(func, ast.Attribute) and func.attr == "write":
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id == "tqdm":
                lines.append(node.lineno)
            elif isinstance(owner, ast.Attribute) and owner.attr in ("stdout", "stderr"):
                lines.append(node.lineno)
    return lines


def test_only_the_command_line_writes_to_the_terminal():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "cli" in path.parents:
            continue
        found += [
            f"{path.relative_to(PACKAGE.parent)}:{line}" for line in _terminal_writes(ast.parse(path.read_text()))
        ]
    assert not found, f"write through logging.getLogger(__name__) instead: {found}"


def test_the_scan_sees_each_kind_of_terminal_write():
    code = "import sys\nprint(1)\nsys.stderr.write('x')\ntqdm.write('y')\nlogger.info('z')\nfile.write('w')\n"
    assert _terminal_writes(ast.parse(code)) == [2, 3, 4]
