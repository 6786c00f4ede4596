"""Diagnostic plug-ins: observers run after aggregation through ``fedmech_flwr.hooks``.

How to add one: subclass ``fedmech_flwr.hooks.Diagnostic``, implement ``server_side``
(``client_side`` / ``client_side_global`` for work on a client's own data, ``plot``
for its figures),
register it with ``@DIAGNOSTICS.register("name", ConfigCls)`` (``check=`` for rules
between its parameters and the experiment or its data, run at validation; see
``fedmech_flwr.registry.Entry.check``) and import it here.
"""

from diagnostics import misalignment, misalignment_table, weight_divergence  # noqa: F401
from diagnostics.circuits import diagnostic  # noqa: F401
from diagnostics.usae import command as usae_command  # noqa: F401
from diagnostics.usae import diagnostic as usae_diagnostic  # noqa: F401
