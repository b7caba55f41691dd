"""Rooms follow the data: `cram.data` is below training, evaluation and the planner, so it never imports them."""

import ast
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "cram" / "data"
ABOVE_DATA = ("cram.train", "cram.eval", "cram.plan")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function, spelled as `from a.b import c` gives `a.b.c`."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


@pytest.mark.parametrize("path", sorted(DATA.glob("*.py")), ids=lambda path: path.name)
def test_the_data_room_imports_nothing_above_it(path):
    above = sorted(module for module in imported_modules(path) if module.startswith(ABOVE_DATA))
    assert not above, f"{path.name} imports {', '.join(above)}: cram/data must not depend on training, eval or planning"
