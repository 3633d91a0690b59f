"""The dashboard's layering, read from its source (no server, nothing imported):

* no module imports a private (``_``-prefixed) name of another dashboard module, nor uses one
  through a module alias (``X._name``);
* the imports between dashboard modules, at any depth (function-level ones too), have no loop;
* the pure producers (spec, frames, index_view, occupancy, summary) read no server, store or
  page: they import none of the API, cache, index-sync, view or metrics-source modules,
  nor httpx or streamlit;
* the old ``data.py`` facade is gone: nothing in the project imports it.

``scripts/check_dashboard_imports.py`` imports each module alone in a fresh interpreter.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DASH = Path(__file__).resolve().parents[1] / "dashboard"
PKG = "prefect_launch.dashboard"
PURE = {"spec", "frames", "index_view", "occupancy", "summary", "page_keeper"}
IO_MODULES = {"api", "api_cache", "index_sync", "view", "metrics_source"}


def _sources() -> dict[str, ast.Module]:
    files = sorted(DASH.glob("*.py")) + sorted((DASH / "pages").glob("*.py"))
    return {str(p.relative_to(DASH).with_suffix("")).replace("/", "."): ast.parse(p.read_text(), str(p)) for p in files}


def _dashboard_module(node: ast.ImportFrom, here: str) -> str | None:
    """The dashboard module an ImportFrom reads from ("" = the package itself), or None."""
    if node.level:  # relative: only within the package
        return node.module or ""
    mod = node.module or ""
    if mod == PKG:
        return ""
    if mod.startswith(PKG + "."):
        return mod[len(PKG) + 1:]
    return None


def _imports(tree: ast.Module, here: str) -> tuple[set[str], list[str], dict[str, str]]:
    """(dashboard modules imported, private names imported, alias -> dashboard module)."""
    mods: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PKG + "."):
                    m = a.name[len(PKG) + 1:]
                    mods.add(m)
                    if a.asname:
                        aliases[a.asname] = m
        elif isinstance(node, ast.ImportFrom):
            src = _dashboard_module(node, here)
            if src is None:
                continue
            for a in node.names:
                if src == "":  # from prefect_launch.dashboard import x [as y]: a module
                    mods.add(a.name)
                    aliases[a.asname or a.name] = a.name
                    if a.name.startswith("_"):
                        private.append(f"{here}: from {PKG} import {a.name}")
                else:
                    mods.add(src)
                    if a.name.startswith("_") and a.name != "__future__":
                        private.append(f"{here}: from {src} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{here}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return mods, private, aliases


@pytest.fixture(scope="module")
def graph() -> dict[str, tuple[set[str], list[str]]]:
    out = {}
    for name, tree in _sources().items():
        mods, private, _ = _imports(tree, name)
        out[name] = (mods - {name}, private)
    return out


def test_no_module_imports_a_private_name_of_another(graph):
    found = [p for _, (_, private) in sorted(graph.items()) for p in private]
    assert found == []


def test_the_dashboard_imports_have_no_loop(graph):
    edges = {m: {d for d in deps if d in graph} for m, (deps, _) in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                raise AssertionError("import loop: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_pure_producers_read_no_server_store_or_page(graph):
    sources = _sources()
    for m in sorted(PURE):
        deps, _ = graph[m]
        assert not deps & IO_MODULES, (m, deps & IO_MODULES)
        top = {a.name.split(".")[0] for n in ast.walk(sources[m]) if isinstance(n, ast.Import) for a in n.names}
        top |= {(n.module or "").split(".")[0] for n in ast.walk(sources[m]) if isinstance(n, ast.ImportFrom)}
        assert not top & {"httpx", "streamlit", "sqlalchemy"}, (m, top & {"httpx", "streamlit", "sqlalchemy"})


def test_the_data_facade_is_gone_and_nothing_imports_it():
    """Every name is imported from the module that owns it; dashboard/data.py (a one-import facade) was deleted."""
    root = DASH.parent
    assert not (DASH / "data.py").exists()
    facade = PKG + ".data"
    found = []
    for top in ("prefect_launch", "dashboard", "workers", "blocks", "flows", "deployments", "tests", "bench", "scripts"):
        for p in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.ImportFrom) and not node.level and (
                        node.module == facade or (node.module == PKG and any(a.name == "data" for a in node.names))):
                    found.append(str(p.relative_to(root)))
                elif isinstance(node, ast.Import) and any(a.name == facade for a in node.names):
                    found.append(str(p.relative_to(root)))
    assert found == []


def test_only_the_frame_and_the_pages_read_streamlit_state():
    """st.navigation and st.cache_resource live in the frame (dashboard/app.py) alone."""
    for m, tree in _sources().items():
        calls = {f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "st"}
        if m != "app":
            assert not calls & {"st.navigation", "st.cache_resource"}, (m, calls & {"st.navigation", "st.cache_resource"})
