"""The names ``fedmech_flwr.api`` had before it was split by role (issue 57), kept for one
release: each still resolves, with a ``DeprecationWarning`` (and a log line, which no
warning filter hides) naming where it is now. This module goes in the next release.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

from fedmech_flwr.api import FACES

FACE_MODULES = tuple(f"fedmech_flwr.api.{face}" for face in FACES)

UNLISTED = {
    "BadFileError": "fedmech_flwr.foundation.errors", "DataNotFoundError": "fedmech_flwr.foundation.errors",
    "RunFolderError": "fedmech_flwr.foundation.errors", "Check": "fedmech_flwr.spec.checks", "ClientData": "fedmech_flwr.contracts.client",
    "Entry": "fedmech_flwr.foundation.registry", "Registry": "fedmech_flwr.foundation.registry", "plugin_registries": "fedmech_flwr.spec.config",
    "ReportsAnotherModel": "fedmech_flwr.contracts.strategy", "StartsFromItsOwnModel": "fedmech_flwr.contracts.strategy",
    "SENT_LOSS": "fedmech_flwr.contracts.strategy", "Resumable": "fedmech_flwr.contracts.hooks", "record_key": "fedmech_flwr.artifacts.folder",
    "register": "fedmech_flwr.api._deprecated", "register_module": "fedmech_flwr.models.wrapped",
}
"""Old names that are neither public now nor used by the built-ins, and their modules."""

REGISTRATION = ("register it with its role's registry, e.g. @STRATEGIES.register(name, ConfigCls) from "
                "fedmech_flwr.api.strategy")


def resolve(name: str, api: str) -> Any:
    """``name`` of the old ``fedmech_flwr.api``, warned about; AttributeError if it never was."""
    face = next((m for m in FACE_MODULES if name in importlib.import_module(m).__all__), None)
    private = importlib.import_module("fedmech_flwr.api._builtin")
    if face is not None:
        value, advice = getattr(importlib.import_module(face), name), f"import it from {face}"
    elif name in private.__all__ or name in UNLISTED:
        value = getattr(private, name) if name in private.__all__ else getattr(importlib.import_module(UNLISTED[name]),
                                                                                   name)
        advice = (REGISTRATION if name in ("register", "register_module")
                  else "it is no longer public: an internal of fedmech's, which may change without notice")
    else:
        raise AttributeError(f"module {api!r} has no attribute {name!r}")
    message = f"{api}.{name} is deprecated and goes in the next release: {advice}"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    logging.getLogger(api).warning(message)
    return value


def register(kind: str, name: str, config_cls: type | None = None, **options: Any) -> Any:
    """The old ``fedmech_flwr.api.register(kind, name, ...)``: ``<REGISTRY>.register(name,
    config_cls, **options)`` of the registry of ``kind``, the entry's module the caller's."""
    import sys

    from fedmech_flwr.spec.config import plugin_registries
    from fedmech_flwr.foundation.errors import ConfigError

    registries = plugin_registries()
    if kind not in registries:
        raise ConfigError(f"unknown plug-in kind '{kind}'; choose one of: {', '.join(registries)}", "register")
    module = options.pop("module", None) or sys._getframe(1).f_globals.get("__name__", "?")
    return registries[kind].register(name, config_cls, module=module, **options)
