"""The map from each source module to the test files that exercise it (``tests/MODULES.md``).

``python tests/module_map.py --write`` regenerates it; ``tests/test_module_map.py`` fails
when the committed map differs, or when a module has no test file and no reason in
``UNTESTED``. Everything is read from the tree each time, by module name: the packages as
``pyproject.toml`` installs them (the built-in plug-ins under ``fedmech_flwr.builtin``), so
a module that moves into a folder keeps its line, under its new name.

A test file ``tests/test_*.py`` exercises a module when

- it imports the module (a name imported from a package counts for the submodule of that
  name), or a package whose ``__init__`` imports the module (``fedmech_flwr.tools.report``
  builds its page with its ``sections``, ``render`` and ``comparisons``);
- a string in it names the module or something in it (a ``mock.patch`` target,
  ``-m fedmech_flwr.tools.reference``), or is, or sets as a ``name``, a plug-in the module
  registers (``"weight_divergence"``, ``strategy.name=moon``);
- it is named after the module (``test_export.py`` for ``fedmech_flwr.tools.export``).

The ``reading the tree`` helpers are also those of ``tests/test_import_graph.py``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP_FILE = Path("tests", "MODULES.md")
COMMAND = "python tests/module_map.py --write"

UNTESTED = {
    "fedmech_flwr.builtin.diagnostics.circuits.plots": "drawn through Circuits.plot: test_circuits_diagnostic.py "
                                                       "draws a run's circuit plots",
    "fedmech_flwr.tools.flwr_console": "what the console shows of flwr run, inside every real launch: "
                                       "test_flwr_run.py checks the console's lines",
    "fedmech_flwr.api._deprecated": "reached by name through fedmech_flwr.api.__getattr__: test_public_api.py "
                                    "checks that every old flat name warns and resolves",
    "fedmech_flwr.api.command": "a face of re-exports, reached by name (reference.api_modules): test_public_api.py "
                                "checks its __all__, docstrings and reference page like every face's",
    "fedmech_flwr.app.client_side": "the diagnostics' part on a node, run inside every ClientApp through "
                                    "fedmech_flwr.app.client_app and fedmech_flwr.app.flower",
    "fedmech_flwr.app.server_app": "the ServerApp that pyproject.toml names for `flwr run`; the real launches "
                                   "(test_flwr_run.py) run it",
    "fedmech_flwr.builtin.strategies.class_stats": "a client query registered under a constant, not a name; "
                                                   "the realign strategies run it",
    "fedmech_flwr.spec.checks": "the ready-made registration checks, run at validation through the plug-ins that "
                           "register with them",
    "fedmech_flwr.foundation.timing": "the diagnostics' clock; the benchmarks read its laps",
}
"""Modules allowed to have no test file, each with its reason."""

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
NAME_SET = re.compile(r"\bname\s*[:=]\s*([\w-]+)")


# --- reading the tree --------------------------------------------------------------------

def installed_packages(root: Path) -> dict[str, Path]:
    """Package name -> its folder, as ``root/pyproject.toml`` installs them."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})

    def folder(package: str) -> Path:
        best = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len, default=None)
        if best is None:
            return root.joinpath(*package.split("."))
        return root / mapped[best] / Path(*package[len(best):].strip(".").split(".") if package != best else ())

    return {package: folder(package) for package in setuptools["packages"]}


def modules_of(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file of every module of the packages (a package is its ``__init__``)."""
    modules = {}
    for package, folder in packages.items():
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> every module it imports, anywhere in its source (top level, in a function,
    under TYPE_CHECKING), relative imports resolved; a name imported from a package is the
    submodule where one of that name exists."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[module] = targets
    return graph


# --- the map -------------------------------------------------------------------------------

def registered_names(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Plug-in name -> the modules that register it (``STRATEGIES.register("moon", ...)``):
    a test runs a plug-in by that name, in a config or an override."""
    names: dict[str, set[str]] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.setdefault(node.args[0].value, set()).add(module)
    return names


def named_in_strings(path: Path, modules: dict[str, Path], plugins: dict[str, set[str]]) -> set[str]:
    """The modules the file's strings name: for each dotted name in a string, the longest
    module name it is or starts with; for a string that is a plug-in's name or sets one
    (``name: moon``, ``strategy.name=moon``), the modules registering that name."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for dotted in DOTTED.findall(node.value):
                parts = dotted.split(".")
                named.update(next(([p] for p in (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                                   if p in modules), []))
            for plugin in (node.value, *NAME_SET.findall(node.value)):
                named.update(plugins.get(plugin, ()))
    return named


def only_docstring(path: Path) -> bool:
    """Whether the file holds nothing but its docstring."""
    tree = ast.parse(path.read_text(), str(path))
    return len(tree.body) == (1 if ast.get_docstring(tree) is not None else 0)


def module_map(root: Path = REPO) -> dict[str, list[str]]:
    """Source module -> the test files that exercise it, both sorted. A package whose
    ``__init__`` holds only its docstring is not a module of the map."""
    every = modules_of(installed_packages(root))
    sources = sorted(name for name, path in every.items() if path.stem != "__init__" or not only_docstring(path))
    tests = {f"test file {path.name}": path for path in sorted((root / "tests").glob("test_*.py"))}
    graph = import_graph({**every, **tests})
    plugins = registered_names(every)
    found: dict[str, list[str]] = {name: [] for name in sources}
    for key, path in tests.items():
        imported = graph[key]
        facades = {own for target in imported if every.get(target, Path()).stem == "__init__"
                   for own in graph[target] if own.startswith(target + ".")}
        by_name = {name for name in sources if path.stem == "test_" + name.rpartition(".")[2]}
        for name in sorted((imported | facades | named_in_strings(path, every, plugins) | by_name) & found.keys()):
            found[name].append(path.name)
    return found


def render(found: dict[str, list[str]], untested: dict[str, str] = UNTESTED) -> str:
    """The map as Markdown: a line per module naming its test files (or why it has none)."""
    lines = ["# The tests of each module", "",
             f"Generated by `{COMMAND}` from the tree and the tests (tests/module_map.py says how a",
             "test file is matched to a module); tests/test_module_map.py checks it. Do not edit.", ""]
    for name, files in found.items():
        lines.append(f"- `{name}`: " + (", ".join(files) or f"no test file ({untested.get(name, 'no reason given')})"))
    return "\n".join(lines) + "\n"


def problems(root: Path = REPO, untested: dict[str, str] = UNTESTED) -> list[str]:
    """What is wrong with ``root``'s map: it differs from the generated one; a module has no
    test file and no reason in ``untested``; a reason names a module that has a test file
    or does not exist."""
    found = module_map(root)
    wrong = [f"{name} has no test file: write one, or say why in UNTESTED (tests/module_map.py)"
             for name, files in found.items() if not files and name not in untested]
    wrong += [f"UNTESTED names {name}, which has a test file or is no module: remove it"
              for name in untested if found.get(name, ["none"])]
    map_file = root / MAP_FILE
    if not map_file.is_file() or map_file.read_text() != render(found, untested):
        wrong.append(f"{MAP_FILE} is not the generated map: run `{COMMAND}` and commit it")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {MAP_FILE}, else print the map")
    text = render(module_map())
    if parser.parse_args(argv).write:
        (REPO / MAP_FILE).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
