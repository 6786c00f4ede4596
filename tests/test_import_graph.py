"""The core's modules import each other without a circle, lazy imports included, and a
ClientApp imports nothing that only the server uses."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

CORE = REPO / "fedmech_flwr"


def core_imports() -> dict[str, set[str]]:
    """Module -> the core modules it imports anywhere in its source (top level, in a
    function, or under TYPE_CHECKING)."""
    def name(path: Path) -> str:
        return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")

    graph = {name(p): set() for p in CORE.rglob("*.py")}
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # a submodule by name, else the module
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in graph else node.module
                           for a in node.names]
            else:
                targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            graph[name(path)] |= {t for t in targets if t in graph}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports as the list of its modules, or None (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_find_cycle_finds_a_known_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_has_no_import_cycle():
    graph = core_imports()
    assert "fedmech_flwr.config" in graph and graph["fedmech_flwr.config"]  # the graph was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def layer(module: str) -> str:
    """``core``, ``app`` (what runs inside Flower) or ``tools`` (what runs around it)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ("app", "tools") else "core"


ALLOWED = {"core": {"core"}, "app": {"core", "app"}, "tools": {"core", "app", "tools"}}
"""Which layers a layer may import: the arrows go one way."""


def test_the_layers_import_one_way():
    graph = core_imports()
    assert {layer(m) for m in graph} == {"core", "app", "tools"}  # the layout was read
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) not in ALLOWED[layer(m)])
    assert wrong == []


SERVER_ONLY = ("matplotlib", "scipy", "sklearn", "pandas")
"""What only the server uses (plots, matching, statistics): every Ray worker and SuperNode
would pay its import at start (about 0.6 s of CPU each for matplotlib and scipy.optimize
on 2 cores)."""


def test_a_clientapp_imports_nothing_only_the_server_uses():
    """The ClientApp with every built-in plug-in (plug-ins import what draws inside
    ``plot``), checked in a fresh interpreter."""
    code = ("import sys, fedmech_flwr.app.client_app, fedmech_flwr.plugins as p; p.load(); "
            f"print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
