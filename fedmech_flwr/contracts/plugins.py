"""The composition root: the one core module that imports plug-ins.

Plug-ins come from three places, and every entry they register records which
(``registry.Entry.origin``):

- the built-in packages ``fedmech_flwr.builtin.clients``, ``.strategies`` and
  ``.diagnostics`` (the repository's top-level ``clients/``, ``strategies/`` and
  ``diagnostics/`` folders, imported beside this core under names that no user package can
  shadow; see ``fedmech_flwr.builtin``);
- the entry points of the group ``fedmech.plugins`` of every installed distribution, each
  naming a module (``median = "my_lab.fed.median"``);
- the modules an experiment lists under ``plugins:`` (``import_plugin``), imported before
  the rest of it is validated.

``load`` imports the first two wherever fedmech starts (the CLI, the ServerApp, every
ClientApp); the experiment's own list is imported wherever it is parsed, so the server and
every client import the same modules. Everything else in the core reaches plug-ins only
through the registries.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from fedmech_flwr import builtin
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.registry import loading

BUILTIN = builtin.__name__
PLUGIN_PACKAGES = tuple(f"{BUILTIN}.{name}" for name in builtin.PACKAGES)
"""The built-in plug-in packages, by the names they are imported under."""
log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fedmech.plugins"
MAKE_IMPORTABLE = ("install the package that provides it in this Python environment (in a deployment: on every "
                   "SuperNode too), or add the folder that holds it to PYTHONPATH")


def load() -> None:
    """Import the built-in packages, then every ``fedmech.plugins`` entry point (idempotent).

    A broken entry point is a ConfigError naming it, its distribution and its module."""
    load_built_in()
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{point.dist.name} {point.dist.version}" if point.dist else "an unknown distribution"
        with loading(f"entry point '{point.name}' of {dist}"):
            try:
                point.load()
                check_api_only(importlib.import_module(point.module))
            except ConfigError:  # a name it registers twice: the message names both origins
                raise
            except Exception as err:
                raise ConfigError(f"the {ENTRY_POINT_GROUP} entry point '{point.name}' of {dist} cannot load module "
                                  f"'{point.module}': {_why(point.module, err)}; or uninstall {dist}") from err


def load_built_in() -> None:
    """Import the built-in packages alone (idempotent): what a reader of run folders runs,
    which imports no installed or experiment's plug-in (``artifacts.reader.recorded_outputs``)."""
    for package in PLUGIN_PACKAGES:
        importlib.import_module(package)


def import_plugin(module: Any, where: str) -> None:
    """Import the plug-in module an experiment lists at ``where`` (``x.yaml: plugins[0]``),
    after the built-in and entry-point plug-ins; its registrations record ``where``."""
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(f"expected a module name such as my_lab.fed.median, got {module!r}", where)
    load()
    with loading(where):
        try:
            imported = importlib.import_module(module)
        except ConfigError:  # a name it registers twice: the message names both origins
            raise
        except Exception as err:
            raise ConfigError(f"cannot import plug-in module '{module}': {_why(module, err)}", where) from err
    check_api_only(imported)


_TOLD: set[str] = set()
"""The plug-in modules ``check_api_only`` has warned about in this process."""


def check_api_only(module: ModuleType) -> None:
    """One warning line, once per process, for a plug-in module whose source imports a
    module of fedmech's outside the public API (``fedmech_flwr.contracts.hooks``, ``.strategy``, the
    built-ins' private ``fedmech_flwr.api._builtin``, ...): those change without notice,
    the API does not. Logged, since Python's default filters
    hide a DeprecationWarning raised outside ``__main__``; the source is read, never run."""
    if module.__name__ in _TOLD or not (internal := internal_imports(module)):
        return
    _TOLD.add(module.__name__)
    log.warning("plug-in %s imports %s: internal modules, which change without notice; import what it needs from "
                "fedmech_flwr.api and its role modules instead (fedmech_flwr.api.strategy, ...: their __all__ list "
                "every name a plug-in may use)",
                module.__name__, ", ".join(internal))


def internal_imports(module: ModuleType) -> list[str]:
    """The ``fedmech_flwr`` modules outside the public API (``is_public``) that ``module``'s
    source imports, read from its syntax tree (none where its source cannot be read)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(_imported_from(node.module, alias.name) for alias in node.names)
    return sorted(n for n in names if n.partition(".")[0] == "fedmech_flwr" and not is_public(n))


def is_public(module: str) -> bool:
    """``fedmech_flwr`` itself, ``fedmech_flwr.api`` or one of its role modules (a name
    imported from the api counts as the api); not a private ``_`` module under it."""
    parts = module.split(".")
    return module == "fedmech_flwr" or (parts[:2] == ["fedmech_flwr", "api"]
                                        and not any(p.startswith("_") for p in parts[2:]))


def _imported_from(module: str, name: str) -> str:
    """What ``from module import name`` imports of the core: the submodule of that name
    where ``module`` is a core package holding one (``from fedmech_flwr.contracts import
    strategy``), else ``module``."""
    folder = Path(__file__).resolve().parents[1].joinpath(*module.split(".")[1:])
    is_module = (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()
    return f"{module}.{name}" if module.partition(".")[0] == "fedmech_flwr" and is_module else module


def _why(module: str, err: Exception) -> str:
    """The import error of ``module``, and what to do: make it importable if it was not
    found, else fix what its import raised."""
    missing = isinstance(err, ModuleNotFoundError) and f"{module}.".startswith(f"{err.name}.")
    return f"{type(err).__name__}: {err}; " + (f"to make it importable, {MAKE_IMPORTABLE}" if missing
                                               else "it was found, but importing it raised this: fix it")
