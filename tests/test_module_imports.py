"""smolbench's modules import each other without cycles (the style guide's rule).

Read from the source with ``ast``: the imports a module makes as it loads (at its top level,
not under ``if TYPE_CHECKING:`` and not inside a function, where an import is lazy on purpose).
A cycle makes the import order decide which names exist, and splits one idea across two files.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "smolbench"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a ``from``-import of ``level`` dots names, seen from ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With):
            todo.extend(node.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each smolbench module and the smolbench modules it imports as it loads."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in _load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level == 0:
                targets = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                here = _resolve(module, is_package, node.level, node.module)
                targets = [here] + [f"{here}.{a.name}" for a in node.names]
            graph[module] |= {t for t in targets if t in paths and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (each once, from its first module in sorted order).
    A package's own submodules imported by its ``__init__`` are not a cycle with it."""
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            at, path = stack.pop()
            for nxt in sorted(graph[at]):
                if nxt == start and len(path) > 1 and not all(m.startswith(start + ".") for m in path[1:]):
                    i = path.index(min(path))
                    found.add(tuple(path[i:] + path[:i]))
                elif nxt not in path and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return [list(c) for c in sorted(found)]


def test_smolbench_s_modules_import_each_other_without_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 100 and graph["smolbench.magics"], "the import graph was not read"
    assert cycles(graph) == []


def test_the_check_finds_a_cycle() -> None:
    """A cycle made up here is found (the check can fail)."""
    graph = import_graph()
    graph["smolbench.gate.display"].add("smolbench.result")  # result imports gate.display
    assert ["smolbench.gate.display", "smolbench.result"] in cycles(graph)
