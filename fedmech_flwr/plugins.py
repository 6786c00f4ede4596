"""The composition root: the one core module that imports the plug-in packages.

Importing ``clients``, ``strategies`` and ``diagnostics`` runs their registrations.
Everything else in the core reaches plug-ins only through the registries.
"""

from __future__ import annotations

import importlib

PLUGIN_PACKAGES = ("clients", "strategies", "diagnostics")


def load() -> None:
    """Import every plug-in package (idempotent)."""
    for package in PLUGIN_PACKAGES:
        importlib.import_module(package)
