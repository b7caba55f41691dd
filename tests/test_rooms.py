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


def module_name(path: Path) -> str:
    parts = path.relative_to(CRAM.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module among `modules` that an imported name is or lies in (`cram.plan.sweep.Setting`: `cram.plan.sweep`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among `graph`'s modules: each strongly connected component of more than one module."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for imported in graph[module]:
            if imported not in order:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], order[imported])
        if lowest[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_two_modules_import_each_other():
    """Within a room too, a module that another imports never imports it back, directly or round a loop (counting
    imports inside functions and under TYPE_CHECKING): each module holds one job and depends on those below it."""
    paths = {module_name(path): path for path in CRAM.rglob("*.py")}
    graph = {module: {module_of(name, paths) for name in imported_modules(path)} - {None, module}
             for module, path in paths.items()}
    assert import_cycles(graph) == []
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
