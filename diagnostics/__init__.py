"""Diagnostic plug-ins: observers run after aggregation, installed as
``fedmech_flwr.builtin.diagnostics``.

How to add one: import what it needs from ``fedmech_flwr.api.diagnostic`` and
``fedmech_flwr.api`` (built-ins also from the private ``fedmech_flwr.api._builtin``; never
another plug-in), subclass ``Diagnostic``, implement ``server_side``
(``client_side`` / ``client_side_global`` for work on a client's own data, ``plot``
for its figures),
register it with ``@DIAGNOSTICS.register("name", ConfigCls)`` (``check=`` for rules
between its parameters and the experiment or its data, run at validation; see
``Entry.check``) and import it here. A plug-in package (``circuits``, ``usae``) imports its
own modules relatively.
"""

from . import misalignment, misalignment_table, neural_collapse, representation_similarity, weight_divergence  # noqa: F401
from .circuits import diagnostic  # noqa: F401
from .usae import command as usae_command  # noqa: F401
from .usae import diagnostic as usae_diagnostic  # noqa: F401
