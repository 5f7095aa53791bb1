"""The project's import graph has no circle: every import between its own modules, at the top of a file or
inside a function, points one way (a circle broken by a deferred import is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("a5core", "tasks", "flows")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported(node: ast.AST, here: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The project's modules one import statement names (a submodule when ``from package import submodule``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package this module is in
            package = here.split(".") if is_package else here.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([base] if base else [])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    else:
        return []
    found = []
    for name in names:  # the longest prefix that is one of ours
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in known:
                found.append(".".join(parts[:end]))
                break
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {
            target for node in ast.walk(tree) for target in imported(node, name, is_package, known) if target != name
        }
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of two or more modules that each import every other, directly or through others."""
    reach = {node: reachable(graph, node) for node in graph}
    found = {tuple(sorted(node for node in reach[a] if a in reach[node])) for a in graph if a in reach[a]}
    return sorted(list(c) for c in found if len(c) > 1)


def test_the_import_graph_has_no_circle():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that import one another): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_imports_point_inward():
    """flows → tasks → a5core: the core imports no task or flow, a task no flow."""
    ring = {package: depth for depth, package in enumerate(PACKAGES)}
    outward = {
        name: sorted(t for t in targets if ring[t.split(".")[0]] > ring[name.split(".")[0]])
        for name, targets in import_graph().items()
    }
    assert not {name: targets for name, targets in outward.items() if targets}


def test_the_loops_do_not_import_the_handouts_entry_points():
    """The handout's adapters call a5core.handout, a front on the loops' own code; the loops never import it."""
    graph = import_graph()
    for loop in ("a5core.loops.grpo.loop", "a5core.loops.sft", "a5core.loops.expert_iteration"):
        assert "a5core.handout" not in reachable(graph, loop), loop
    assert "a5core.loops.grpo.objective" in reachable(graph, "a5core.handout")  # it fronts the loop's objective
