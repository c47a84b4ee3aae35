"""The package's layer order: a module imports only its own layer or the layers below it, and no
modules import each other in a circle.

    errors, files, readers, config, process_memory, progress, ops  <  data, layers  <  models  <  train, eval  <  hf, cli

Imports inside functions count (they run too); those under `if TYPE_CHECKING:` do not. The root
`farsight/__init__.py` is the public facade: it loads names lazily and belongs to no layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "farsight"

LAYERS = (
    {"errors", "files", "readers", "config", "process_memory", "progress", "ops"},
    {"data", "layers"},
    {"models"},
    {"train", "eval"},
    {"hf", "cli", "__main__"},
)


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package`."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that `name` imports (the longest known prefix of each import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    type_checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(child) for child in ast.walk(node))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: anchor at this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((i for i, layer in enumerate(LAYERS) if parts[1] in layer), None)


def layer_problems(package: Path) -> list[str]:
    """Upward imports, modules outside every layer, and import circles, one line each."""
    files = module_names(package)
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    root = package.name
    problems = []
    for name in sorted(graph):
        if name == root:
            continue
        own = layer_of(name)
        if own is None:
            problems.append(f"{name} is in no layer; add its top-level name to LAYERS")
            continue
        for target in sorted(graph[name]):
            other = layer_of(target)
            if other is not None and other > own:
                problems.append(f"{name} imports {target}, a higher layer")
    problems += [f"import circle: {' <-> '.join(circle)}" for circle in circles(graph)]
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_farsight_keeps_its_layer_order():
    assert layer_problems(PACKAGE) == []


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "farsight"
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_an_upward_import_is_reported(tmp_path):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "ops/__init__.py": "",
            "ops/kernel.py": "def f():\n    from farsight.models.model import Model\n",
            "models/__init__.py": "",
            "models/model.py": "from farsight.ops.kernel import f\nclass Model: ...\n",
        },
    )
    problems = layer_problems(package)
    assert "farsight.ops.kernel imports farsight.models.model, a higher layer" in problems
    assert "import circle: farsight.models.model <-> farsight.ops.kernel" in problems


def test_relative_imports_and_type_checking_blocks(tmp_path):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "ops/__init__.py": "from .kernel import f\n",
            "ops/kernel.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from farsight.models import M\n",
            "models/__init__.py": "from ..ops import kernel\nM = 1\n",
            "stray.py": "",
        },
    )
    assert layer_problems(package) == ["farsight.stray is in no layer; add its top-level name to LAYERS"]
