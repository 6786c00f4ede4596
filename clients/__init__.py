"""Client plug-ins: ``fedmech_flwr.client.FedMechClient`` subclasses (Flower NumPyClients).

How to add one: subclass ``FedMechClient``, override ``loss`` (or ``fit``), register it
with ``@CLIENTS.register("name", ConfigCls)`` (``pairs_with=`` when it only works with
certain strategies, ``check=`` for rules between its parameters and the experiment or its
data, run at validation) and import the module here.
"""

from clients import (  # noqa: F401
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
