"""Deprecated: the diagnostics for your own Flower app moved to ``fedmech_flwr.app.flower``.

This module forwards to it (``WithDiagnostics``, ``attach_diagnostics`` and the rest), with
a DeprecationWarning, until the next release; import ``fedmech_flwr.app.flower`` instead.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings

from fedmech_flwr.app import flower as _new
from fedmech_flwr.app.flower import *  # noqa: F403  (the same names, for one release)
from fedmech_flwr.app.flower import __all__  # noqa: F401

NEW_PATH = _new.__name__

_MESSAGE = f"fedmech_flwr.flower is deprecated and goes in the next release: import {NEW_PATH} instead"


def _importer_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` that points at the code importing this module:
    past this module and the import machinery (whose ``_bootstrap`` frames ``warnings``
    skips without counting them, and ``importlib``'s ``import_module``)."""
    frame, level = sys._getframe(1), 1
    while (frame := frame.f_back) is not None:
        file = frame.f_code.co_filename
        if "importlib" in file and "_bootstrap" in file:
            continue
        level += 1
        if file not in (__file__, importlib.__file__):
            break
    return level


warnings.warn(_MESSAGE, DeprecationWarning, stacklevel=_importer_stacklevel())
logging.getLogger(__name__).warning(_MESSAGE)  # Python hides a DeprecationWarning outside __main__; a log shows


def __getattr__(name: str) -> object:
    """Any other name of the new module (its helpers and types), as before."""
    return getattr(_new, name)
