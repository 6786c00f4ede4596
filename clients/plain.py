"""Plain local training: cross-entropy with Adam or SGD, magnitude pruning per the config."""

from __future__ import annotations

from fedmech_flwr.api.client import CLIENTS, FedMechClient


@CLIENTS.register("plain")
class PlainClient(FedMechClient):
    """The FedAvg client of McMahan et al. (2017): minimise the local cross-entropy.

    Everything it does is the shared ``FedMechClient.fit``; it exists as the named
    baseline that other behaviours (proximal, logit-calibrated, ...) are compared to.
    """
