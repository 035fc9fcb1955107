"""No import cycle among our packages (webapi, flows, tasks, blocks, faceflow).

How it checks: every ``.py`` file of those packages is parsed with ``ast`` (nothing is
imported), and every ``import`` / ``from ... import`` statement anywhere in it — at
module level, inside functions and methods, under ``if TYPE_CHECKING:`` — gives an edge
from the file's module to the module it names (``from a.b import c`` names ``a.b.c`` when
that is a module of ours, else ``a.b``; relative imports are resolved; a name inside a
module resolves to that module). Imports done by string (``importlib.import_module``)
are not seen. The modules' graph must have no strongly connected component of more than
one module (Tarjan's algorithm), so no module reaches itself through imports, however
late the import runs. ``KNOWN_CYCLES`` lists the accepted exceptions (none today).

The same graph checks the layers (``LAYERS``): which of our modules each module may
import, so that the packages' one direction of knowledge (docs/architecture.md) holds too,
and a module-level cycle cannot start as an upward import hidden in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("webapi", "flows", "tasks", "blocks", "faceflow")
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()
"""Cycles accepted for now, each with its reason in a comment (prefer fixing)."""

Graph = dict[str, dict[str, int]]  # module -> {imported module: first line}

#: The run contract between the webapi and the flows (torch- and Prefect-free).
CONTRACT = ("flows", "flows.params", "flows.binding")
#: Flows that run the webapi's passes on the control pool: they sit above the webapi.
CONTROL_FLOWS = ("flows.reconcile", "flows.retention")
#: Each layer, top down: its modules (a module named, else the longest dotted prefix) and the
#: layers below it that it may import (besides its own).
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "faceflow": (("faceflow",), ("control", "webapi", "flows", "contract", "blocks", "tasks")),
    "control": (CONTROL_FLOWS, ("webapi", "contract", "blocks", "tasks")),
    "webapi": (("webapi",), ("contract", "tasks")),
    "flows": (("flows",), ("contract", "blocks", "tasks")),
    "contract": (CONTRACT, ("tasks",)),
    "blocks": (("blocks",), ("tasks",)),
    "tasks": (("tasks",), ()),
}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Our modules by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _ours(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` (a module or a name inside one) lives in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(root: Path = REPO) -> Graph:
    """Each module's imports of our modules, from every import statement in its source."""
    known = modules(root)
    graph: Graph = {name: {} for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _named(node, name, path.name == "__init__.py"):
                ours = _ours(target, known)
                if ours is not None and ours != name:
                    graph[name].setdefault(ours, node.lineno)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, list(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, list(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def _describe(component: list[str], graph: Graph) -> str:
    members = set(component)
    edges = [
        f"  {module}:{line} imports {target}"
        for module in component
        for target, line in sorted(graph[module].items())
        if target in members
    ]
    return "cycle among " + ", ".join(component) + "\n" + "\n".join(edges)


def test_no_import_cycle_among_our_modules() -> None:
    graph = import_graph()
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "\n".join(_describe(c, graph) for c in found)


def layer_of(module: str) -> str:
    """The layer a module belongs to: the (lowest) one naming it, else the longest prefix
    of it."""
    named = [layer for layer, (modules, _below) in LAYERS.items() if module in modules]
    prefixed = [
        (len(prefix), layer)
        for layer, (prefixes, _below) in LAYERS.items()
        for prefix in prefixes
        if module.startswith(prefix + ".")
    ]
    return named[-1] if named else max(prefixed, default=(0, ""))[1]


def breaches(graph: Graph) -> list[str]:
    """Every import of a module in a layer its importer may not import."""
    found = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        allowed = {layer, *LAYERS[layer][1]}
        for target, line in sorted(targets.items()):
            if layer_of(target) not in allowed:
                found.append(f"{module}:{line} ({layer}) imports {target} ({layer_of(target)})")
    return found


def test_every_import_points_down_the_layers() -> None:
    assert not breaches(import_graph()), "\n".join(breaches(import_graph()))


def test_the_layers_cover_every_module_and_see_an_upward_import() -> None:
    graph = import_graph()
    assert all(layer_of(module) for module in graph)
    assert layer_of("flows.params") == "contract" and layer_of("flows.fuse") == "flows"
    assert layer_of("flows.reconcile") == "control" and layer_of("flows") == "contract"
    upward = {**graph, "flows.fuse": {**graph["flows.fuse"], "webapi.relay.runner": 1}}
    assert breaches(upward) == ["flows.fuse:1 (flows) imports webapi.relay.runner (webapi)"]
    downward = {**graph, "webapi.crud": {**graph["webapi.crud"], "flows.run": 1}}
    assert breaches(downward) == ["webapi.crud:1 (webapi) imports flows.run (flows)"]


def test_the_check_sees_late_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle closed only by a function-level, a relative or a
    TYPE_CHECKING import is found; a one-way chain is not a cycle."""
    package = tmp_path / "webapi"
    (package / "relay").mkdir(parents=True)
    for name in ("tasks", "flows", "blocks", "faceflow"):
        (tmp_path / name).mkdir()
    (package / "__init__.py").write_text("")
    (package / "relay" / "__init__.py").write_text("")
    (package / "relay" / "a.py").write_text("from webapi.relay import b\n")
    (package / "relay" / "b.py").write_text("def f():\n    from .c import x\n")
    (package / "relay" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from webapi.relay.a import y\n"
    )
    (package / "relay" / "d.py").write_text("import webapi.relay.a\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["webapi.relay.a", "webapi.relay.b", "webapi.relay.c"]]
    assert graph["webapi.relay.b"] == {"webapi.relay.c": 2}
    (package / "relay" / "c.py").write_text("x = 1\n")
    assert cycles(import_graph(tmp_path)) == []
