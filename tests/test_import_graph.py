"""The import graph of the whole installed tree: the core's modules import each other
without a circle, lazy imports included, in layers that point one way (each folder of the
core is a layer, ``LAYERS``, and no module sits outside one); the core imports no
plug-in (only the plug-in loader names them); a plug-in imports nothing of fedmech's but
``fedmech_flwr.api`` and its modules (neither the app nor the tools, nor another plug-in, nor
another core module); only the built-in plug-ins import the API's private module
``fedmech_flwr.api._builtin``; each rule fails on a planted violation; and a ClientApp
imports nothing that only the server uses.

The tree is read as ``pyproject.toml`` installs it (``[tool.setuptools] packages`` and
``package-dir``): the built-in plug-ins under ``fedmech_flwr.builtin``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from module_map import import_graph, installed_packages, modules_of

BUILTIN = "fedmech_flwr.builtin"
FOLDERS = ("clients", "strategies", "diagnostics")
"""The built-in plug-in packages' folders: imported by these top-level names (where the
repository's root is on ``sys.path``), they would be a second copy of their plug-ins."""
LOADER = "fedmech_flwr.contracts.plugins"
"""The one core module that names the built-in plug-in packages (it imports them by name)."""
API = "fedmech_flwr.api"
PRIVATE = "fedmech_flwr.api._builtin"
"""What the built-in plug-ins use beyond the public API: theirs alone."""
DEPRECATED = {"fedmech_flwr.flower": {"fedmech_flwr.app.flower"}}
"""Old public paths kept for one release, each importing only its new home."""


def is_plugin(module: str) -> bool:
    return module.startswith(BUILTIN + ".")


def is_fedmech(module: str) -> bool:
    """A module of this project: the core, a built-in plug-in, or a plug-in folder's top-level name."""
    return module.split(".")[0] in ("fedmech_flwr", *FOLDERS)


def plugin_unit(module: str) -> str:
    """The plug-in a built-in module belongs to: ``fedmech_flwr.builtin.strategies.fedavg``,
    ``fedmech_flwr.builtin.diagnostics.circuits`` (a package is one plug-in), or the plug-in
    package itself for its ``__init__`` (which lists its plug-ins)."""
    return ".".join(module.split(".")[:4])


LAYERS = ("foundation", "models", "learning", "datasets", "contracts", "spec", "artifacts", "api", "app", "tools")
"""The core's layers, lowest first: each folder of ``fedmech_flwr``, and ``api`` for the
modules at its top (the public face). A layer may import only itself and the layers below
it: the arrows go one way, up to ``app`` (what runs inside Flower) and ``tools`` (what runs
around it)."""
PUBLIC_FACE = {"fedmech_flwr", "fedmech_flwr.api", *DEPRECATED}
"""The only modules at the top of ``fedmech_flwr``: every other module sits in a layer's folder."""


def layer(module: str) -> str:
    """The layer of a core module: its folder under ``fedmech_flwr``, or ``api`` at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "api"


# --- the rules -----------------------------------------------------------------------------

def core_violations(graph: dict[str, set[str]]) -> list[str]:
    """A core module that imports a built-in plug-in (by its name or its folder's),
    or imports across the layers the wrong way."""
    wrong = []
    for module, targets in graph.items():
        if is_plugin(module):
            continue
        for target in sorted(targets):
            if is_plugin(target) or target.split(".")[0] in FOLDERS:
                wrong.append(f"{module} -> {target}: the core imports a plug-in (only {LOADER} loads them, by name)")
            elif (target in graph and not is_plugin(target) and target != BUILTIN  # the plug-ins' home: no layer
                  and LAYERS.index(layer(target)) > LAYERS.index(layer(module))
                  and target not in DEPRECATED.get(module, ())):
                wrong.append(f"{module} -> {target}: {layer(module)} imports {layer(target)}, a layer above it")
    return sorted(wrong)


def is_api(module: str) -> bool:
    return module == API or module.startswith(API + ".")


def unlayered(graph: dict[str, set[str]]) -> list[str]:
    """Core modules outside every layer: at the top of ``fedmech_flwr`` but not its public
    face, or in a folder that ``LAYERS`` does not name."""
    def placed(module: str) -> bool:
        parts = module.split(".")
        return module in PUBLIC_FACE or len(parts) > 1 and parts[1] in LAYERS

    return sorted(m for m in graph if m.split(".")[0] == "fedmech_flwr" and not is_plugin(m) and m != BUILTIN
                  and not placed(m))


def plugin_violations(graph: dict[str, set[str]]) -> list[str]:
    """A built-in plug-in module that imports anything of fedmech's but ``fedmech_flwr.api``
    (its role modules and its private module included) and its own plug-in's modules (a
    plug-in package's ``__init__``: the plug-ins it lists)."""
    wrong = []
    for module, targets in graph.items():
        if not is_plugin(module):
            continue
        unit = plugin_unit(module)
        for target in sorted(t for t in targets if is_fedmech(t)):
            if is_api(target) or plugin_unit(target) == unit:
                continue
            if module.count(".") == 2 and target.startswith(module + "."):  # a plug-in package's list
                continue
            if target.split(".")[0] in FOLDERS:
                why = "a plug-in by its folder's top-level name"
            elif is_plugin(target):
                why = "another plug-in (go through fedmech_flwr.api: a registry, decode_results)"
            elif layer(target) in ("app", "tools"):
                why = f"fedmech_flwr.{layer(target)}"
            else:
                why = "a core module other than fedmech_flwr.api"
            wrong.append(f"{module} -> {target}: {why}")
    return sorted(wrong)


def private_api_violations(graph: dict[str, set[str]]) -> list[str]:
    """A module other than a built-in plug-in (the core, a user's package) that imports the
    API's private module: what it holds may change in any release."""
    return sorted(f"{module} -> {PRIVATE}: only the built-in plug-ins may import it; a plug-in of your own imports "
                  f"{API} and its role modules" for module, targets in graph.items()
                  if PRIVATE in targets and not is_plugin(module))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports as the list of its modules, or None (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(d for d in graph[module] if d in graph):
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


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(modules_of(installed_packages(REPO)))


# --- the installed tree holds the rules ------------------------------------------------------

def test_the_tree_is_read_as_installed(graph):
    assert "fedmech_flwr.spec.config" in graph and graph["fedmech_flwr.spec.config"]
    assert f"{BUILTIN}.strategies.fedavg" in graph and f"{BUILTIN}.diagnostics.circuits.gates" in graph
    assert graph[f"{BUILTIN}.diagnostics.circuits.diagnostic"] >= {"fedmech_flwr.api",
                                                                   f"{BUILTIN}.diagnostics.circuits.gates"}
    assert {layer(m) for m in graph if not is_plugin(m)} == set(LAYERS)


def uninstalled_folders(root: Path) -> list[Path]:
    """Package folders (with an ``__init__.py``) under the core and the built-in plug-in
    packages that ``root/pyproject.toml`` does not list: an install would leave them out."""
    packages = installed_packages(root)
    roots = [packages["fedmech_flwr"], *(packages[p] for p in packages if p.count(".") == 2 and is_plugin(p))]
    listed = {folder.resolve() for folder in packages.values()}
    return sorted({init.parent.resolve() for r in roots for init in r.rglob("__init__.py")} - listed)


def test_every_package_folder_is_installed():
    assert uninstalled_folders(REPO) == []


def test_the_core_has_no_import_cycle(graph):
    core = {m: {t for t in ts if t in graph and not is_plugin(t)} for m, ts in graph.items() if not is_plugin(m)}
    assert find_cycle(core) is None, " -> ".join(find_cycle(core))


def test_the_core_imports_no_plugin_and_its_layers_import_one_way(graph):
    assert core_violations(graph) == []


def test_every_core_module_sits_in_a_layer(graph):
    assert unlayered(graph) == []


def test_plugins_import_only_the_api_and_their_own_modules(graph):
    assert plugin_violations(graph) == []
    assert sum(any(map(is_api, targets)) for m, targets in graph.items() if is_plugin(m)) > 30  # read


def test_only_the_builtin_plugins_import_the_private_api(graph):
    assert private_api_violations(graph) == []
    assert {PRIVATE, f"{API}.strategy"} <= graph[f"{BUILTIN}.strategies.fednova"]  # read


def named_strings(path: Path) -> set[str]:
    """The string constants of a module's code (its docstrings left out)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_only_the_loader_names_the_builtin_plugin_packages():
    """No core module but the loader spells a built-in plug-in package's name; the loader
    imports exactly the installed ones, from their folders at the top of the repository."""
    from fedmech_flwr.contracts import plugins

    names = {f"{BUILTIN}.{name}" for name in FOLDERS}
    spelled = sorted(str(path.relative_to(REPO)) for path in (REPO / "fedmech_flwr").rglob("*.py")
                     if path.name != "plugins.py"
                     and any(text == name or text.startswith(name + ".") for text in named_strings(path)
                             for name in names))
    assert spelled == []
    assert set(plugins.PLUGIN_PACKAGES) == names
    for name in FOLDERS:
        assert (REPO / name / "__init__.py").is_file()


def test_find_cycle_finds_a_known_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# --- each rule fails on a planted violation --------------------------------------------------

PLANTED = {
    "pyproject.toml": """
[tool.setuptools]
packages = ["fedmech_flwr", "fedmech_flwr.api", "fedmech_flwr.foundation", "fedmech_flwr.learning",
            "fedmech_flwr.contracts", "fedmech_flwr.spec", "fedmech_flwr.artifacts", "fedmech_flwr.stray",
            "fedmech_flwr.app", "fedmech_flwr.tools", "fedmech_flwr.builtin",
            "fedmech_flwr.builtin.strategies", "fedmech_flwr.builtin.diagnostics",
            "fedmech_flwr.builtin.diagnostics.probe", "my_lab"]

[tool.setuptools.package-dir]
"fedmech_flwr.builtin.strategies" = "strategies"
"fedmech_flwr.builtin.diagnostics" = "diagnostics"
""",
    "fedmech_flwr/__init__.py": "",
    "fedmech_flwr/api/__init__.py": "from fedmech_flwr.foundation.registry import Registry\n",
    "fedmech_flwr/api/strategy.py": "from fedmech_flwr.foundation.registry import Registry\n",
    "fedmech_flwr/api/_builtin.py": "from fedmech_flwr.foundation.registry import Registry\n",
    "fedmech_flwr/foundation/registry.py": "class Registry: ...\n",
    "fedmech_flwr/spec/config.py": "def load():\n    from fedmech_flwr.builtin.strategies import mean  # a plug-in\n",
    "fedmech_flwr/contracts/hooks.py": "import strategies.mean  # the same, by the old name\n",
    "fedmech_flwr/artifacts/plotting.py": ("from fedmech_flwr.tools import cli  # the core on the tools\n"
                                           "from fedmech_flwr.api._builtin import Registry  # the core on the private api\n"),
    "fedmech_flwr/learning/arrays.py": "from fedmech_flwr.spec.config import load  # a layer on one above it\n",
    "fedmech_flwr/spec/experiment.py": "from fedmech_flwr.learning import arrays  # on one below: allowed\n",
    "fedmech_flwr/helpers.py": "",
    "fedmech_flwr/stray/thing.py": "",
    "fedmech_flwr/contracts/plugins.py": "import importlib\n",
    "fedmech_flwr/builtin/__init__.py": "",
    "fedmech_flwr/app/__init__.py": "",
    "fedmech_flwr/app/run.py": "from fedmech_flwr.api import Registry\n",
    "fedmech_flwr/tools/__init__.py": "",
    "fedmech_flwr/tools/cli.py": "from fedmech_flwr.app import run\n",
    "strategies/__init__.py": "from . import mean, median  # its list: allowed\n",
    "strategies/mean.py": ("import numpy as np\n\nfrom fedmech_flwr.api import Registry  # allowed\n"
                           "from fedmech_flwr.api.strategy import Registry  # allowed\n"
                           "from fedmech_flwr.api._builtin import Registry  # a built-in: allowed\n"),
    "strategies/median.py": ("from fedmech_flwr.app.run import Registry\n"
                             "from fedmech_flwr.foundation.registry import Registry\n"
                             "from .mean import np\n"
                             "from strategies import mean\n"
                             "def plot():\n    from fedmech_flwr.tools.cli import run\n"),
    "diagnostics/__init__.py": "from .probe import core  # its list: allowed\n",
    "diagnostics/probe/__init__.py": "",
    "diagnostics/probe/core.py": "from . import heads  # its own package: allowed\nfrom ..probe.heads import x\n",
    "diagnostics/probe/heads.py": "from fedmech_flwr.api import Registry\nfrom ...strategies import mean\nx = 1\n",
    "my_lab/__init__.py": "",
    "my_lab/median.py": ("from fedmech_flwr.api.strategy import Registry  # a user's plug-in: allowed\n"
                         "from fedmech_flwr.api import _builtin  # a user's plug-in on the private api\n"),
}


@pytest.fixture
def planted(tmp_path) -> dict[str, set[str]]:
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return import_graph(modules_of(installed_packages(tmp_path)))


def test_the_planted_tree_is_read_with_relative_imports_resolved(planted):
    assert planted[f"{BUILTIN}.diagnostics.probe.core"] == {f"{BUILTIN}.diagnostics.probe.heads"}
    assert planted[f"{BUILTIN}.diagnostics.probe.heads"] == {"fedmech_flwr.api", f"{BUILTIN}.strategies.mean"}
    assert planted[f"{BUILTIN}.strategies"] == {f"{BUILTIN}.strategies.mean", f"{BUILTIN}.strategies.median"}


def test_a_core_module_importing_a_plugin_or_a_higher_layer_is_caught(planted):
    assert core_violations(planted) == [
        f"fedmech_flwr.artifacts.plotting -> {PRIVATE}: artifacts imports api, a layer above it",
        "fedmech_flwr.artifacts.plotting -> fedmech_flwr.tools.cli: artifacts imports tools, a layer above it",
        f"fedmech_flwr.contracts.hooks -> strategies.mean: the core imports a plug-in (only {LOADER} loads them, "
        "by name)",
        "fedmech_flwr.learning.arrays -> fedmech_flwr.spec.config: learning imports spec, a layer above it",
        f"fedmech_flwr.spec.config -> {BUILTIN}.strategies.mean: the core imports a plug-in (only {LOADER} loads them, "
        "by name)",
    ]


def test_a_users_plugin_or_the_core_importing_the_private_api_is_caught(planted):
    assert planted[f"{BUILTIN}.strategies.mean"] >= {"fedmech_flwr.api", "fedmech_flwr.api.strategy", PRIVATE}
    assert private_api_violations(planted) == [
        f"fedmech_flwr.artifacts.plotting -> {PRIVATE}: only the built-in plug-ins may import it; a plug-in of your "
        "own imports "
        "fedmech_flwr.api and its role modules",
        f"my_lab.median -> {PRIVATE}: only the built-in plug-ins may import it; a plug-in of your own imports "
        "fedmech_flwr.api and its role modules",
    ]


def test_a_core_module_outside_every_layer_is_caught(planted):
    assert unlayered(planted) == ["fedmech_flwr.helpers", "fedmech_flwr.stray.thing"]


def test_a_plugin_importing_the_app_the_tools_the_core_or_another_plugin_is_caught(planted):
    median = f"{BUILTIN}.strategies.median"
    assert plugin_violations(planted) == [
        f"{BUILTIN}.diagnostics.probe.heads -> {BUILTIN}.strategies.mean: another plug-in (go through "
        "fedmech_flwr.api: a registry, decode_results)",
        f"{median} -> fedmech_flwr.app.run: fedmech_flwr.app",
        f"{median} -> {BUILTIN}.strategies.mean: another plug-in (go through fedmech_flwr.api: a registry, "
        "decode_results)",
        f"{median} -> fedmech_flwr.foundation.registry: a core module other than fedmech_flwr.api",
        f"{median} -> fedmech_flwr.tools.cli: fedmech_flwr.tools",
        f"{median} -> strategies: a plug-in by its folder's top-level name",
    ]


def test_an_uninstalled_package_folder_is_caught(planted, tmp_path):
    assert uninstalled_folders(tmp_path) == []
    (tmp_path / "strategies" / "robust").mkdir()
    (tmp_path / "strategies" / "robust" / "__init__.py").write_text("")
    assert uninstalled_folders(tmp_path) == [(tmp_path / "strategies" / "robust").resolve()]


def test_a_plugin_package_named_in_code_is_caught_and_one_named_in_a_docstring_is_not(tmp_path):
    module = tmp_path / "loader.py"
    module.write_text('''"""Loads fedmech_flwr.builtin.strategies."""\nimport importlib\n\n\ndef load():\n'''
                      '''    """The fedmech_flwr.builtin.clients too."""\n'''
                      '''    importlib.import_module("fedmech_flwr.builtin.clients")\n''')
    assert named_strings(module) == {"fedmech_flwr.builtin.clients"}


# --- what a ClientApp imports ---------------------------------------------------------------

SERVER_ONLY = ("matplotlib", "scipy", "sklearn", "pandas")
"""What only the server uses (plots, matching, statistics): every Ray worker and SuperNode
would pay its import at start (about 0.6 s of CPU each for matplotlib and scipy.optimize
on 2 cores)."""


def test_a_clientapp_imports_nothing_only_the_server_uses():
    """The ClientApp with every built-in plug-in (plug-ins import what draws inside
    ``plot``), checked in a fresh interpreter."""
    code = ("import sys, fedmech_flwr.app.client_app, fedmech_flwr.contracts.plugins as p; p.load(); "
            f"print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
