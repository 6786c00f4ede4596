"""What a diagnostic plug-in needs: its registry, the base class, what it is given each
round (server side and client side), what it returns, and the figures it may draw.

``line_plot`` and ``heatmap`` are imported on first use: matplotlib is the server's alone,
and every ClientApp imports the plug-ins (and so this module).

Examples
--------
>>> from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult
>>> @DIAGNOSTICS.register("round_number")
... class RoundNumber(Diagnostic):
...     def server_side(self, state):
...         return DiagnosticResult({"clients": len(state.clients)})
"""

from __future__ import annotations

from fedmech_flwr.contracts.conformance import check_diagnostic
from typing import Any

from fedmech_flwr.contracts.hooks import (
    DIAGNOSTICS,
    ClientContext,
    ClientUpdate,
    Diagnostic,
    DiagnosticResult,
    GlobalContext,
    RoundState,
)

__all__ = [
    "DIAGNOSTICS", "Diagnostic", "DiagnosticResult",
    # what it is given: the server's round, or a client's data and model
    "ClientContext", "ClientUpdate", "GlobalContext", "RoundState",
    # figures (imported on first use)
    "heatmap", "line_plot",
    # testing
    "check_diagnostic",
]

_FIGURES = ("heatmap", "line_plot")


def __getattr__(name: str) -> Any:
    if name in _FIGURES:
        from fedmech_flwr.artifacts import plotting

        return getattr(plotting, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
