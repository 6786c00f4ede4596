"""Client plug-ins: ``FedMechClient`` subclasses (Flower NumPyClients), installed as
``fedmech_flwr.builtin.clients``.

How to add one: import what it needs from ``fedmech_flwr.api.client`` and
``fedmech_flwr.api`` (built-ins also from the private ``fedmech_flwr.api._builtin``), subclass ``FedMechClient``, override ``loss`` (or ``fit``), register it
with ``@CLIENTS.register("name", ConfigCls)`` (``pairs_with=`` when it only works with
certain strategies, ``check=`` for rules between its parameters and the experiment or its
data, run at validation) and import the module here.
"""

from . import (  # noqa: F401
    etf,
    fedbabu,
    feddecorr,
    feddyn,
    fedlc,
    fednova,
    fedrod,
    fedrs,
    moon,
    plain,
    proximal,
    scaffold,
)
