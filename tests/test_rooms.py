"""Rooms follow the data: data → models → train → eval and plan. A room never imports a room above it, so the
micro-batch's walk (planner probe → train loop → data loader) and every other only goes down."""

import ast
from pathlib import Path

import pytest

CRAM = Path(__file__).resolve().parents[1] / "cram"
ABOVE = {  # each room, and the rooms above it that it must not import
    "data": ("cram.models", "cram.train", "cram.eval", "cram.plan", "cram.bench"),
    "models": ("cram.train", "cram.eval", "cram.plan", "cram.bench"),
    "train": ("cram.eval", "cram.plan", "cram.bench"),
}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function, spelled as `from a.b import c` gives `a.b.c`."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


@pytest.mark.parametrize("path", sorted(path for room in ABOVE for path in (CRAM / room).glob("*.py")),
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_no_room_imports_a_room_above_it(path):
    above = sorted(module for module in imported_modules(path) if module.startswith(ABOVE[path.parent.name]))
    assert not above, f"{path.parent.name}/{path.name} imports {', '.join(above)}, a room above it"
