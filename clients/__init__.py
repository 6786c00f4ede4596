"""Client plug-ins: ``fedmech_flwr.client.FedMechClient`` subclasses (Flower NumPyClients).

How to add one: subclass ``FedMechClient``, override ``loss`` (or ``fit``), register it
with ``@CLIENTS.register("name", ConfigCls)`` (``pairs_with=`` when it only works with
certain strategies, ``check=`` for rules between its parameters and the experiment or its
data, run at validation) and import the module here.
"""

from clients import fedbabu, feddyn, fedlc, fednova, plain, proximal, scaffold  # noqa: F401
