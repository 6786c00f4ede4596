"""The composition root: the one core module that imports plug-ins.

Plug-ins come from three places, and every entry they register records which
(``registry.Entry.origin``):

- the built-in packages ``clients``, ``strategies`` and ``diagnostics``;
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

import importlib
from importlib import metadata
from typing import Any

from fedmech_flwr.errors import ConfigError
from fedmech_flwr.registry import loading

PLUGIN_PACKAGES = ("clients", "strategies", "diagnostics")
ENTRY_POINT_GROUP = "fedmech.plugins"
MAKE_IMPORTABLE = ("install the package that provides it in this Python environment (in a deployment: on every "
                   "SuperNode too), or add the folder that holds it to PYTHONPATH")


def load() -> None:
    """Import the built-in packages, then every ``fedmech.plugins`` entry point (idempotent).

    A broken entry point is a ConfigError naming it, its distribution and its module."""
    for package in PLUGIN_PACKAGES:
        importlib.import_module(package)
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{point.dist.name} {point.dist.version}" if point.dist else "an unknown distribution"
        with loading(f"entry point '{point.name}' of {dist}"):
            try:
                point.load()
            except ConfigError:  # a name it registers twice: the message names both origins
                raise
            except Exception as err:
                raise ConfigError(f"the {ENTRY_POINT_GROUP} entry point '{point.name}' of {dist} cannot load module "
                                  f"'{point.module}': {_why(point.module, err)}; or uninstall {dist}") from err


def import_plugin(module: Any, where: str) -> None:
    """Import the plug-in module an experiment lists at ``where`` (``x.yaml: plugins[0]``),
    after the built-in and entry-point plug-ins; its registrations record ``where``."""
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(f"expected a module name such as my_lab.fed.median, got {module!r}", where)
    load()
    with loading(where):
        try:
            importlib.import_module(module)
        except ConfigError:  # a name it registers twice: the message names both origins
            raise
        except Exception as err:
            raise ConfigError(f"cannot import plug-in module '{module}': {_why(module, err)}", where) from err


def _why(module: str, err: Exception) -> str:
    """The import error of ``module``, and what to do: make it importable if it was not
    found, else fix what its import raised."""
    missing = isinstance(err, ModuleNotFoundError) and f"{module}.".startswith(f"{err.name}.")
    return f"{type(err).__name__}: {err}; " + (f"to make it importable, {MAKE_IMPORTABLE}" if missing
                                               else "it was found, but importing it raised this: fix it")
