"""Client plug-ins: ``fedmech_flwr.client.FedMechClient`` subclasses (Flower NumPyClients).

How to add one: subclass ``FedMechClient``, override ``loss`` (or ``fit``), register it
with ``@CLIENTS.register("name", ConfigCls)`` and import the module here.
"""

from clients import plain  # noqa: F401
