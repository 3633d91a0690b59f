"""The package's modules import each other without a loop (pure: reads the tree).

Module-level imports only: an import inside a function runs when it is called (after every module has
loaded), and ``if TYPE_CHECKING:`` imports never run. The dashboard's own check (test_dashboard_layers)
is stricter and counts function-level imports too.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "dashboard", "deployments", "flows", "blocks", "prefect_launch")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts if parts[0] == "prefect_launch" else ("prefect_launch", *parts))
    return name.removesuffix(".__init__")


def module_level_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else (node,):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                out.add(n.module)
                out.update(f"{n.module}.{a.name}" for a in n.names)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
    return out & known


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for d in PACKAGES for p in (ROOT / d).rglob("*.py")}
    return {m: module_level_imports(p, set(files)) - {m} for m, p in files.items()}


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_loops_are_found_where_there_are_some():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_module_level_import_loop():
    graph = import_graph()
    assert "prefect_launch.workers.agent.core" in graph  # the tree was read
    assert loops(graph) == [], "module-level import loops (import one side inside a function, or split the module)"
