"""CONTRIBUTING.md's map of import layers is true to the source: each module or folder of the package imports
only from the lines above its own, and every one of them is on the map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch_xla_ext"


def _unit(module: str) -> str:
    """The top-level module or folder of ``torch_xla_ext`` that ``module`` (dotted) belongs to."""
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[dotted.removesuffix(".__init__")] = path
    return found


def _edges() -> set[tuple[str, str]]:
    """(importing unit, imported unit) for every import between two units, inside functions too."""
    modules = _modules()
    edges = set()
    for name, path in modules.items():
        if name == "torch_xla_ext":
            continue
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = base.split(".")[:len(base.split(".")) - (node.level - 1)]
                target = ".".join(parts + ([node.module] if node.module else []))
                candidates = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.ImportFrom):
                candidates = [node.module or ""]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for candidate in candidates:
                if candidate in modules and candidate != "torch_xla_ext":
                    if _unit(candidate) != _unit(name):
                        edges.add((_unit(name), _unit(candidate)))
                    break
    return edges


def _map() -> list[list[str]]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "CONTRIBUTING.md has no ```layers block"
    return [line.split() for line in block.group(1).strip().splitlines()]


def test_every_unit_of_the_package_is_on_the_map_once():
    listed = [unit for line in _map() for unit in line]
    units = {_unit(name) for name in _modules() if name != "torch_xla_ext"}
    assert sorted(listed) == sorted(set(listed)), "a unit is listed twice"
    assert set(listed) == units, f"missing: {units - set(listed)}; not in the package: {set(listed) - units}"


def test_each_unit_imports_only_from_lines_above_its_own():
    line_of = {unit: k for k, line in enumerate(_map()) for unit in line}
    upward = sorted(f"{a} (line {line_of[a] + 1}) imports {b} (line {line_of[b] + 1})"
                    for a, b in _edges() if line_of[b] >= line_of[a])
    assert not upward, "\n".join(upward)
