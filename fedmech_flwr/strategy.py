"""The strategy registry and the contract strategy plug-ins follow.

A strategy plug-in registers a factory ``factory(params, ctx: StrategyContext) -> flwr
Strategy``. The strategy must train every node it is offered: the round protocol
(:mod:`fedmech_flwr.app.protocol`) samples clients by partition-id and offers only those.
Build Flower strategies with ``**OFFERED_NODES_ONLY`` to get that behaviour. A strategy
that keeps state across rounds (server momentum, control variates) implements
``fedmech_flwr.hooks.Resumable`` so that a resumed run restores it.

A strategy that pairs with its own client sends it arrays as extra ArrayRecords of the
train message (the client reads them in ``FedMechClient.received``) and reads what the
client uploads (``FedMechClient.upload``) from a reply with ``uploaded``. A client's
own state across rounds is the client's (``FedMechClient.state``), kept by the core.

A strategy with a client side registers its query handlers in ``CLIENT_QUERIES``, as a
diagnostic overrides ``client_side``: ``handler(QueryContext) -> RecordDict``. The strategy
sends ``query.<name>`` with :func:`fedmech_flwr.wire.query_nodes`: arrays, and a
config record holding the train config's entries (the experiment, the round) plus its own;
every ClientApp answers with the handler's record, computed on the client's own data
(``strategies/class_stats.py``: the per-class feature statistics NCM and CCVR ask for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import Strategy

from fedmech_flwr.arrays import NamedArrays, unpack
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.registry import Registry
from fedmech_flwr.wire import REPORT_KEY, UPLOAD_PREFIX

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
    """The experiment's seed, for ``fedmech_flwr.seeds.seed_for`` with a named purpose and the round."""
    round_timeout_s: float
    """How long a strategy's own round trips to the clients may wait."""
    initial: NamedArrays
    """The model every run starts from (round 0)."""
    build_model: Callable[[NamedArrays], FedMechModel]
    """A fresh model (eval mode, on the run's device) holding the given arrays."""
    audit: tuple[torch.Tensor, torch.Tensor] | None
    """The server-held audit set (``data.audit_per_class``, on the run's device), held out
    from every client; None when the experiment has none."""
    num_clients: int
    """Clients in the federation (``federation.num_clients``), sampled or not: the N of
    SCAFFOLD's and FedDyn's server updates."""
    pruned: bool = False
    """The clients prune (``pruning.mode: magnitude``): a weight at exactly 0 in every reply
    is pruned, and a server step keeps it at 0."""


STRATEGIES: Registry[Callable[[Any, StrategyContext], Strategy]] = Registry("strategy")


SENT_ACCURACY, SENT_LOSS = "sent-model-accuracy", "sent-model-loss"
"""The strategy metrics that hold the sent model's test accuracy and loss where a strategy
reports another model (``ReportsAnotherModel``)."""


@runtime_checkable
class ReportsAnotherModel(Protocol):
    """A strategy whose accuracy, as its paper reports it, describes another model than the
    one it sends the clients (FedDyn: the plain mean of the client models, while the
    corrected model goes to the clients). Every other strategy's accuracy describes the
    model it sends.

    The run evaluates and diagnoses ``reported(sent)``, the model of the round whose
    aggregate is ``sent``, and saves it as the final model; checkpoints and resume points
    keep the sent model. Where the two differ, the round's strategy metrics also hold the
    sent model's test accuracy and loss (``SENT_ACCURACY``, ``SENT_LOSS``)."""

    reports: str
    """The model the accuracy describes, in words (the run logs it)."""

    def reported(self, sent: NamedArrays) -> NamedArrays: ...


@dataclass
class QueryContext:
    """What a strategy's client-side query handler may read inside the ClientApp."""

    server_round: int
    partition_id: int
    model: FedMechModel
    """The model the query carried (eval mode, on the client's device)."""
    config: ConfigRecord
    """The query's config: the train config's entries (the experiment, the round) and the
    strategy's own."""
    x: torch.Tensor
    y: torch.Tensor
    """The client's own training data."""
    num_classes: int
    device: torch.device
    seed: int
    """The experiment's seed, for ``fedmech_flwr.seeds.seed_for`` with the partition and round."""
    batch_size: int
    """The experiment's evaluation batch size, for forward passes over ``x``."""


CLIENT_QUERIES: Registry[Callable[[QueryContext], RecordDict]] = Registry("client query")
"""Strategies' client-side handlers by query name: ``query.<name>`` is answered with
``handler(ctx)``'s record."""


def uploaded(reply: Message, name: str) -> NamedArrays:
    """The arrays a train reply's client uploaded under ``name`` (``FedMechClient.upload``);
    a RuntimeError naming the client's plug-in pairing when it sent none."""
    report = reply.content.config_records[REPORT_KEY]
    if UPLOAD_PREFIX + name not in report:
        raise RuntimeError(f"client {report['partition-id']} uploaded no '{name}' arrays: the strategy needs the "
                           "client it pairs with (see `fedmech list strategies`)")
    return unpack(report[UPLOAD_PREFIX + name])
