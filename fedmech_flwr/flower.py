"""Deprecated: the diagnostics for your own Flower app moved to ``fedmech_flwr.app.flower``.

This module forwards to it (``WithDiagnostics``, ``attach_diagnostics`` and the rest), with
a DeprecationWarning, until the next release; import ``fedmech_flwr.app.flower`` instead.
"""

from __future__ import annotations

import logging
import warnings

from fedmech_flwr.app import flower as _new
from fedmech_flwr.app.flower import *  # noqa: F403  (the same names, for one release)
from fedmech_flwr.app.flower import __all__  # noqa: F401
from fedmech_flwr.plugins import importer_stacklevel

NEW_PATH = _new.__name__

_MESSAGE = f"fedmech_flwr.flower is deprecated and goes in the next release: import {NEW_PATH} instead"

warnings.warn(_MESSAGE, DeprecationWarning, stacklevel=importer_stacklevel())
logging.getLogger(__name__).warning(_MESSAGE)  # Python hides a DeprecationWarning outside __main__; a log shows


def __getattr__(name: str) -> object:
    """Any other name of the new module (its helpers and types), as before."""
    return getattr(_new, name)
