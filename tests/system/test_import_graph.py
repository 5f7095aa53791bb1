"""The project's import graph has no circle: every import between its own modules, at the top of a file or
inside a function, points one way (a circle broken by a deferred import is still a circle); the rings import
inward (flows → tasks → a5core); inside a5core, each room imports only the rooms below it, in one order."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("a5core", "tasks", "flows")
# a5core's rooms, bottom to top: each imports only rooms below it (and itself). runtime is the ground floor
# (ranks, checkpoints, atomic writes, settings, progress: used by every room); grading works on text alone
# (answers, rewards); data builds problem and trace sets, filtered by the grader; policy is the model and its
# losses; engines generate from a policy's weights (and a served teacher); evaluation grades an engine's
# completions; the loops train with all of them; verdicts judge the runs they make.
ROOMS = ("runtime", "grading", "data", "policy", "engines", "evaluation", "loops", "verdicts")
# Above every room: the package's front (the handout's names, imported lazily) and the handout's own entry points.
FRONT = ("a5core", "a5core.handout")


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


def room_of(module: str) -> int:
    """The floor of an a5core module: its room's place in ROOMS, or one above them all for the front."""
    if module in FRONT:
        return len(ROOMS)
    return ROOMS.index(module.split(".")[1])


def test_every_a5core_module_is_in_a_room_or_the_front():
    outside = [m for m in modules() if m.startswith("a5core") and m not in FRONT and m.split(".")[1] not in ROOMS]
    assert not outside


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each a5core module's imports of a room above its own."""
    upward = {
        name: sorted(t for t in targets if t.startswith("a5core") and room_of(t) > room_of(name))
        for name, targets in graph.items()
        if name.startswith("a5core")
    }
    return {name: targets for name, targets in upward.items() if targets}


def test_rooms_import_downward_only():
    """Each room of a5core imports only itself and the rooms below it (deferred imports count)."""
    assert not upward_imports(import_graph())


def test_an_upward_import_is_found():
    graph = {"a5core.runtime.checkpoint": {"a5core.data.files", "a5core.runtime.distributed"}}
    assert upward_imports(graph) == {"a5core.runtime.checkpoint": ["a5core.data.files"]}
    assert upward_imports({"a5core.handout": {"a5core.loops.grpo.objective"}}) == {}  # the front sits on top


def test_the_loops_do_not_import_the_handouts_entry_points():
    """The handout's adapters call a5core.handout, a front on the loops' own code; the loops never import it."""
    graph = import_graph()
    for loop in ("a5core.loops.grpo.loop", "a5core.loops.sft", "a5core.loops.expert_iteration"):
        assert "a5core.handout" not in reachable(graph, loop), loop
    assert "a5core.loops.grpo.objective" in reachable(graph, "a5core.handout")  # it fronts the loop's objective
