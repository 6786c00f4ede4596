"""What a client plug-in needs: its registry and the base class to subclass.

Examples
--------
>>> import torch
>>> from fedmech_flwr.api.client import CLIENTS, FedMechClient
>>> @CLIENTS.register("smooth_labels")
... class SmoothLabels(FedMechClient):
...     def loss(self, logits, y):
...         return torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
"""

from __future__ import annotations

from fedmech_flwr.contracts.client import CLIENTS, FedMechClient
from fedmech_flwr.contracts.conformance import check_client

__all__ = [
    "CLIENTS", "FedMechClient",
    # testing
    "check_client",
]
