"""FedAvg (McMahan et al. 2017, arXiv:1602.05629), weighted by examples or uniform.

The client must return its weights and ``num-examples`` in the reply's MetricRecord.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedmech_flwr.arrays import NamedArrays, from_record, to_record, weighted_mean
from fedmech_flwr.strategy import OFFERED_NODES_ONLY, STRATEGIES, StrategyContext

log = logging.getLogger(__name__)


@dataclass
class FedAvgConfig:
    weighting: Literal["examples", "uniform"] = "examples"
    """``examples`` is canonical FedAvg (weights proportional to local sample counts);
    ``uniform`` averages clients equally, as the paper's code does."""


class WeightedFedAvg(FedAvg):
    """Flower's FedAvg with a choice of client weights and dtype-preserving averaging.

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
        """The aggregate of the replies' ``models`` (client weights ``weights``), and this
        strategy's own metrics of the round, added to the returned MetricRecord (with
        ``aggregate-seconds``, the server's time to aggregate)."""
        return weighted_mean(models, weights), {}


@STRATEGIES.register("fedavg", FedAvgConfig)
def fedavg(params: FedAvgConfig, ctx: StrategyContext) -> WeightedFedAvg:
    return WeightedFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)
