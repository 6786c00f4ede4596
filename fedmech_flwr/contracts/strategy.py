"""The strategy registry, the contract strategy plug-ins follow, and their base class.

A strategy plug-in registers a factory ``factory(params, ctx: StrategyContext) -> flwr
Strategy``. The strategy must train every node it is offered: the round protocol
(:mod:`fedmech_flwr.app.protocol`) samples clients by partition-id and offers only those.
Build Flower strategies with ``**OFFERED_NODES_ONLY`` to get that behaviour. Most
strategies subclass ``WeightedFedAvg`` (the ``fedavg`` strategy, with ``FedAvgConfig`` its
parameters) and override one step: ``average`` for an aggregation rule, or one of Flower's
``configure_train`` / ``aggregate_train``. A strategy
that keeps state across rounds (server momentum, control variates) implements
``fedmech_flwr.contracts.hooks.Resumable`` so that a resumed run restores it.

A strategy that pairs with its own client sends it arrays as extra ArrayRecords of the
train message (the client reads them in ``FedMechClient.received``) and reads what the
client uploads (``FedMechClient.upload``) from a reply with ``uploaded``. A client's
own state across rounds is the client's (``FedMechClient.state``), kept by the core.

A strategy with a client side registers its query handlers in ``CLIENT_QUERIES``, as a
diagnostic overrides ``client_side``: ``handler(QueryContext) -> RecordDict``. The strategy
sends ``query.<name>`` with :func:`fedmech_flwr.contracts.wire.query_nodes`: arrays, and a
config record holding the train config's entries (the experiment, the round) plus its own;
every ClientApp answers with the handler's record, computed on the client's own data
(the built-in ``class_stats`` query: the per-class feature statistics NCM and CCVR ask for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fedmech_flwr.contracts.wire import REPORT_KEY, UPLOAD_PREFIX
from fedmech_flwr.foundation.registry import Registry
from fedmech_flwr.learning.arrays import NamedArrays, from_record, to_record, unpack, weighted_mean
from fedmech_flwr.models import FedMechModel

log = logging.getLogger(__name__)

OFFERED_NODES_ONLY: dict[str, Any] = {
    "fraction_train": 1.0,
    "min_train_nodes": 1,
    "min_available_nodes": 1,
    # Evaluation of the global model happens on the server every round.
    "fraction_evaluate": 0.0,
}
"""Flower FedAvg-family arguments: train all offered nodes, no federated evaluation."""


@dataclass(kw_only=True)
class StrategyContext:
    """What a strategy may use besides its own parameters, fixed for the run (built with
    keywords: nine fields in a row are easy to swap)."""

    num_classes: int
    num_rounds: int
    seed: int
    """The experiment's seed, for ``fedmech_flwr.foundation.seeds.seed_for`` with a named purpose and the round."""
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


@runtime_checkable
class StartsFromItsOwnModel(Protocol):
    """A strategy whose method fixes part of the model before training starts (FedETF: the
    simplex-ETF head). The run starts from ``initial_model(initial)``, so round 0 evaluates,
    and round 1 sends, the model the method begins with, not the randomly initialised one."""

    def initial_model(self, initial: NamedArrays) -> NamedArrays: ...


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
    """The experiment's seed, for ``fedmech_flwr.foundation.seeds.seed_for`` with the partition and round."""
    batch_size: int
    """The experiment's evaluation batch size, for forward passes over ``x``."""


CLIENT_QUERIES: Registry[Callable[[QueryContext], RecordDict]] = Registry("client query")
"""Strategies' client-side handlers by query name: ``query.<name>`` is answered with
``handler(ctx)``'s record."""


def uploaded(reply: Message, name: str) -> NamedArrays:
    """The arrays a train reply's client uploaded under ``name`` (``FedMechClient.upload``):
    how a strategy reads what its paired client sends besides its weights.

    Parameters
    ----------
    reply : flwr.app.Message
        One train reply, as ``aggregate_train`` gets it.
    name : str
        The name the client uploaded under (SCAFFOLD's ``"control-delta"``).

    Returns
    -------
    NamedArrays

    Raises
    ------
    RuntimeError
        When the client sent none: the message names the plug-in pairing the strategy needs.

    Examples
    --------
    >>> deltas = [uploaded(reply, "control-delta") for reply in replies]  # doctest: +SKIP
    """
    report = reply.content.config_records[REPORT_KEY]
    if UPLOAD_PREFIX + name not in report:
        raise RuntimeError(f"client {report['partition-id']} uploaded no '{name}' arrays: the strategy needs the "
                           "client it pairs with (see `fedmech list strategies`)")
    return unpack(report[UPLOAD_PREFIX + name])


def parameter_names(ctx: StrategyContext) -> list[str]:
    """The model's float parameters (``named_parameters``), which carry the methods' states;
    buffers do not."""
    return [name for name, _ in ctx.build_model(ctx.initial).named_parameters()]


@dataclass
class FedAvgConfig:
    """The ``fedavg`` strategy's parameters, and those of the methods whose server averages
    as FedAvg does.

    Parameters
    ----------
    weighting : {"examples", "uniform"}
        ``examples`` weighs each client by its sample count (canonical FedAvg).

    Examples
    --------
    >>> FedAvgConfig(weighting="uniform")
    FedAvgConfig(weighting='uniform')
    """

    weighting: Literal["examples", "uniform"] = "examples"
    """``examples`` is canonical FedAvg (weights proportional to local sample counts);
    ``uniform`` averages clients equally, as the paper's code does."""


class WeightedFedAvg(FedAvg):
    """FedAvg (McMahan et al. 2017, arXiv:1602.05629): Flower's FedAvg with a choice of
    client weights and dtype-preserving averaging; the ``fedavg`` strategy, and the base
    of most others (a new aggregation rule overrides ``average``).

    The client must return its weights and ``num-examples`` in the reply's MetricRecord.

    Overrides ``aggregate_train``: the mean is taken in float64, in the order the replies
    arrive (the round protocol sorts them by partition-id), and integer buffers stay
    integers (Flower's own average turns them into float64). And ``summary``: Flower's says
    "Weighted by: 'num-examples'" (the key it reads) whatever the weighting.
    """

    def __init__(self, weighting: str = "examples", **kwargs) -> None:
        super().__init__(**kwargs)
        self.weighting = weighting
        self.sent: NamedArrays = {}
        """The model this round's clients start from (what rules that step from it read)."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.sent = from_record(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def summary(self) -> None:
        """The start-up log: sampling, and how the average is really weighted."""
        log.info("\t├──> Sampling: the nodes the round protocol offers (fraction_train %.2f, at least %d)",
                 self.fraction_train, self.min_train_nodes)
        if type(self).average is not WeightedFedAvg.average:  # a subclass's own rule, e.g. fedmech new's median
            model = f"{type(self).__name__}.average"
        elif self.weighting == "examples":
            model = f"weighted by '{self.weighted_by_key}'"
        else:
            model = "uniform (1 per client)"
        log.info("\t└──> Average: model weights %s; train metrics weighted by '%s'", model, self.weighted_by_key)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(list(replies), is_train=True)
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        models = [from_record(next(iter(c.array_records.values()))) for c in contents]
        if self.weighting == "uniform":
            weights = [1.0] * len(contents)
        else:
            weights = [float(next(iter(c.metric_records.values()))[self.weighted_by_key]) for c in contents]
        start = time.perf_counter()
        arrays, own = self.average(server_round, contents, models, weights)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        for key, value in {**own, "aggregate-seconds": time.perf_counter() - start}.items():
            metrics[key] = value
        return to_record(arrays), metrics

    def average(
        self, server_round: int, contents: list[RecordDict], models: list[NamedArrays], weights: list[float]
    ) -> tuple[NamedArrays, dict[str, int | float]]:
        """The aggregate of one round's replies: what a new aggregation rule overrides (the
        default is the weighted mean).

        Parameters
        ----------
        server_round : int
        contents : list of flwr.app.RecordDict
            The replies' contents, for what a client sent besides its weights.
        models : list of NamedArrays
            Each client's weights.
        weights : list of float
            Each client's weight (``weighting``: its sample count, or 1).

        Returns
        -------
        (NamedArrays, dict)
            The new global model, and this strategy's own metrics of the round (added to the
            returned MetricRecord, with ``aggregate-seconds``, the server's time to aggregate).

        Examples
        --------
        >>> import numpy as np
        >>> class Median(WeightedFedAvg):
        ...     def average(self, server_round, contents, models, weights):
        ...         return {k: np.median(np.stack([m[k] for m in models]), axis=0).astype(models[0][k].dtype)
        ...                 for k in models[0]}, {}
        """
        return weighted_mean(models, weights), {}


def weighted_fedavg(params: FedAvgConfig, ctx: StrategyContext) -> WeightedFedAvg:
    # The factory of FedAvg and of the methods whose server averages as FedAvg does (their
    # rule lives in their client). No docstring: a registered entry's summary is then its
    # registering module's, which names the method's paper.
    return WeightedFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)
