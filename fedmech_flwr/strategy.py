"""The strategy registry and the contract strategy plug-ins follow.

A strategy plug-in registers a factory ``factory(params, ctx: StrategyContext) -> flwr
Strategy``. The strategy must train every node it is offered: the round protocol
(:mod:`fedmech_flwr.protocol`) samples clients by partition-id and offers only those.
Build Flower strategies with ``**OFFERED_NODES_ONLY`` to get that behaviour. A strategy
that keeps state across rounds (server momentum, control variates) implements
``fedmech_flwr.protocol.Resumable`` so that a resumed run restores it.

A strategy that needs the clients' per-class feature statistics of a model (data-free
head realignment) asks for them with :func:`request_class_stats`; every ClientApp answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedmech_flwr.arrays import NamedArrays, from_record
from fedmech_flwr.heads import ClassStats, Covariance
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.protocol import query_nodes
from fedmech_flwr.registry import Registry

log = logging.getLogger(__name__)

CLASS_STATS_ACTION = "class_stats"
"""``query.class_stats``: a client's per-class feature statistics of the sent model."""

OFFERED_NODES_ONLY: dict[str, Any] = {
    "fraction_train": 1.0,
    "min_train_nodes": 1,
    "min_available_nodes": 1,
    # Evaluation of the global model happens on the server every round.
    "fraction_evaluate": 0.0,
}
"""Flower FedAvg-family arguments: train all offered nodes, no federated evaluation."""


@dataclass
class StrategyContext:
    """What a strategy may use besides its own parameters, fixed for the run."""

    num_classes: int
    num_rounds: int
    seed: int
    round_timeout_s: float
    """How long a strategy's own round trips to the clients may wait."""
    initial: NamedArrays
    """The model every run starts from (round 0)."""
    build_model: Callable[[NamedArrays], FedMechModel]
    """A fresh model (eval mode, on the run's device) holding the given arrays."""
    audit: tuple[torch.Tensor, torch.Tensor] | None
    """The server-held audit set (``data.audit_per_class``, on the run's device), held out
    from every client; None when the experiment has none."""


STRATEGIES: Registry[Callable[[Any, StrategyContext], Strategy]] = Registry("strategy")


def request_class_stats(
    grid: Grid, node_ids: Iterable[int], arrays: ArrayRecord, config: ConfigRecord, covariance: Covariance, timeout: float
) -> ClassStats:
    """Ask nodes for per-class statistics of ``arrays``' penultimate features on their
    own data; return the statistics summed over the nodes that answered (failures are
    logged). ``config`` must carry the experiment (the train config does)."""
    query = ConfigRecord({**dict(config), "covariance": covariance})
    parts, failed = [], []
    for reply in query_nodes(grid, node_ids, CLASS_STATS_ACTION, arrays, query, timeout):
        if reply.has_error():
            failed.append(reply.metadata.src_node_id)
            log.warning("node %d sent no class statistics: %s", reply.metadata.src_node_id, reply.error.reason)
            continue
        parts.append(ClassStats.from_arrays(from_record(reply.content["stats"])))
    if not parts:
        raise RuntimeError(f"no node returned class statistics (failed: {failed})")
    return ClassStats.sum(parts)
