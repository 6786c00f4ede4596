"""The composition root: the one core module that imports plug-ins.

Plug-ins come from three places, and every entry they register records which
(``registry.Entry.origin``):

- the built-in packages ``fedmech_flwr.builtin.clients``, ``.strategies`` and
  ``.diagnostics`` (the repository's top-level ``clients/``, ``strategies/`` and
  ``diagnostics/`` folders, installed under names that no user package can shadow; see
  ``fedmech_flwr.builtin``); one found anywhere but beside this ``fedmech_flwr`` is refused;
- the entry points of the group ``fedmech.plugins`` of every installed distribution, each
  naming a module (``median = "my_lab.fed.median"``);
- the modules an experiment lists under ``plugins:`` (``import_plugin``), imported before
  the rest of it is validated.

``load`` imports the first two wherever fedmech starts (the CLI, the ServerApp, every
ClientApp); the experiment's own list is imported wherever it is parsed, so the server and
every client import the same modules. Everything else in the core reaches plug-ins only
through the registries.

Until the next release the old top-level names of the built-in packages (``clients``,
``strategies``, ``diagnostics``, as in ``from strategies.fedavg import WeightedFedAvg``)
still import, with a DeprecationWarning naming the new path, wherever no other package of
that name is found (``install_old_names``): a user's own ``strategies`` always wins.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import warnings
from importlib import metadata
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType
from typing import Any

from fedmech_flwr import builtin
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.registry import loading

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
    which imports no installed or experiment's plug-in (``run_reader.recorded_outputs``)."""
    for package in PLUGIN_PACKAGES:
        check_builtin(importlib.import_module(package))


def check_builtin(package: ModuleType) -> None:
    """Refuse a built-in plug-in package imported from anywhere but beside this core
    (``fedmech_flwr.builtin.home()``): another checkout's or install's plug-ins would
    register their own versions under the built-in names."""
    expected = builtin.home() / package.__name__.rpartition(".")[2] / "__init__.py"
    found = getattr(package, "__file__", None)
    if found is None or Path(found).resolve() != expected:
        raise ConfigError(f"the built-in plug-in package {package.__name__} was imported from "
                          f"{found or 'nowhere (no file)'}, but this fedmech ({Path(__file__).resolve().parent}) has "
                          f"it at {expected}: another "
                          "checkout or install of fedmech is on sys.path (PYTHONPATH, a .pth file); remove it, or "
                          "reinstall this one (pip install -e .)", "fedmech_flwr.plugins")


OLD_NAMES = builtin.PACKAGES
"""The built-in packages' top-level names before they moved under ``fedmech_flwr.builtin``."""


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``strategies.fedavg`` (an old name) as a module that forwards to
    ``fedmech_flwr.builtin.strategies.fedavg``, with a DeprecationWarning, unless another
    package of that top-level name is on ``sys.path`` (a user's own ``strategies``), which
    is then imported, even where the repository's root comes first on ``sys.path`` (its
    folder, ``flwr run .``'s app bundle). The built-in folders themselves are never imported
    under their old names: each plug-in would register a second time."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in OLD_NAMES:
            return None
        if fullname == top:
            home = builtin.home()
            others = [entry for entry in sys.path if Path(entry or ".").resolve() != home]
            if (found := PathFinder.find_spec(top, others)) is not None:
                return found  # another package of that name, the user's: it wins wherever it is on sys.path
        elif not getattr(sys.modules.get(top), "__fedmech_forwards_to__", None):
            return None
        new = importlib.util.find_spec(f"{BUILTIN}.{fullname}")
        if new is None:
            return None
        return ModuleSpec(fullname, self, is_package=new.submodule_search_locations is not None)

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new_name = f"{BUILTIN}.{module.__name__}"
        new = importlib.import_module(new_name)
        hint = "fedmech_flwr.api" if module.__name__ == "strategies.fedavg" else new_name
        message = (f"{module.__name__} is deprecated and goes in the next release: import {hint} instead "
                   "(a plug-in needs only fedmech_flwr.api)")
        warnings.warn(message, DeprecationWarning, stacklevel=importer_stacklevel())
        log.warning(message)  # Python hides a DeprecationWarning outside __main__; a log line shows
        module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})
        module.__doc__ = new.__doc__
        module.__all__ = getattr(new, "__all__", [k for k in vars(new) if not k.startswith("_")])
        module.__fedmech_forwards_to__ = new_name
        if hasattr(new, "__path__"):
            module.__path__ = []  # its submodules come through this finder too


def importer_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, from the frame calling it, that points at the code
    importing the module warned about: past that module, this one, ``importlib`` and the
    import machinery (whose frames ``warnings`` skips without counting them)."""
    frame, level = sys._getframe(1), 1
    own = frame.f_code.co_filename
    while (frame := frame.f_back) is not None:
        file = frame.f_code.co_filename
        if "importlib" in file and "_bootstrap" in file:
            continue
        level += 1
        if file not in (own, __file__, importlib.__file__):
            break
    return level


def install_old_names() -> None:
    """Let the old top-level names import (deprecated; see ``_OldNames``); idempotent. It
    goes first on ``sys.meta_path``, to keep the built-in folders from being imported under
    the old names."""
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())


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
    """One warning line, once per process, for a plug-in module whose source imports a core
    module other than ``fedmech_flwr.api`` (``fedmech_flwr.hooks``, ``.strategy``, ...):
    those change without notice, the api does not. Logged, since Python's default filters
    hide a DeprecationWarning raised outside ``__main__``; the source is read, never run."""
    if module.__name__ in _TOLD or not (internal := internal_imports(module)):
        return
    _TOLD.add(module.__name__)
    log.warning("plug-in %s imports %s: internal modules, which change without notice; import what it needs from "
                "fedmech_flwr.api instead (its __all__ lists every name a plug-in may use)",
                module.__name__, ", ".join(internal))


def internal_imports(module: ModuleType) -> list[str]:
    """The ``fedmech_flwr`` modules other than the api that ``module``'s source imports,
    read from its syntax tree (none where its source cannot be read)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update([f"{node.module}.{alias.name}" for alias in node.names] if node.module == "fedmech_flwr"
                         else [node.module])
    return sorted(n for n in names if n.partition(".")[0] == "fedmech_flwr" and n != "fedmech_flwr.api"
                  and n != "fedmech_flwr")


def _why(module: str, err: Exception) -> str:
    """The import error of ``module``, and what to do: make it importable if it was not
    found, else fix what its import raised."""
    missing = isinstance(err, ModuleNotFoundError) and f"{module}.".startswith(f"{err.name}.")
    return f"{type(err).__name__}: {err}; " + (f"to make it importable, {MAKE_IMPORTABLE}" if missing
                                               else "it was found, but importing it raised this: fix it")
