"""What a strategy plug-in needs: its registry, FedAvg to subclass, the strategy's context,
the arrays it averages, what its paired client uploads, client queries, and mocked replies
for its tests.

Examples
--------
>>> from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, WeightedFedAvg
>>> @STRATEGIES.register("uniform_avg")
... def uniform_avg(params, ctx):
...     return WeightedFedAvg(weighting="uniform", **OFFERED_NODES_ONLY)
"""

from __future__ import annotations

from fedmech_flwr.contracts.conformance import check_strategy
from fedmech_flwr.contracts.strategy import (
    CLIENT_QUERIES,
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    QueryContext,
    StrategyContext,
    WeightedFedAvg,
    uploaded,
)
from fedmech_flwr.contracts.testing import train_replies
from fedmech_flwr.contracts.wire import query_nodes
from fedmech_flwr.learning.arrays import NamedArrays, from_record, to_record, weighted_mean

__all__ = [
    "STRATEGIES", "FedAvgConfig", "OFFERED_NODES_ONLY", "StrategyContext", "WeightedFedAvg",
    # the arrays it averages, and what a paired client uploads
    "NamedArrays", "from_record", "to_record", "uploaded", "weighted_mean",
    # work on the clients' data (a client query)
    "CLIENT_QUERIES", "QueryContext", "query_nodes",
    # testing
    "check_strategy",
    "train_replies",
]
