"""The strategy registry and the contract strategy plug-ins follow.

A strategy plug-in registers a factory ``factory(params) -> flwr Strategy``. The
strategy must train every node it is offered: the round protocol
(:mod:`fedmech_flwr.protocol`) samples clients by partition-id and offers only those.
Build Flower strategies with ``**OFFERED_NODES_ONLY`` to get that behaviour. A strategy
that keeps state across rounds (server momentum, control variates) implements
``fedmech_flwr.protocol.Resumable`` so that a resumed run restores it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedmech_flwr.registry import Registry

STRATEGIES: Registry[Callable[[Any], Strategy]] = Registry("strategy")

OFFERED_NODES_ONLY: dict[str, Any] = {
    "fraction_train": 1.0,
    "min_train_nodes": 1,
    "min_available_nodes": 1,
    # Evaluation of the global model happens on the server every round.
    "fraction_evaluate": 0.0,
}
"""Flower FedAvg-family arguments: train all offered nodes, no federated evaluation."""
