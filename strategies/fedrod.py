"""FedRoD (Chen & Chao 2022, ICLR, arXiv:2107.00778): FedAvg of the body and the generic head.

The client must be ``fedrod``: it trains the body and the model's head (the generic head)
on the balanced softmax loss and keeps a personal head on its node (see
``clients/fedrod.py``). The server averages what the clients send, the body and the
generic head, as FedAvg does; the personal heads never reach it. The global model it
evaluates is the body with the generic head.
"""

from __future__ import annotations

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, FedAvgConfig, StrategyContext, WeightedFedAvg

KEY = "fedrod-personal-accuracy"
"""The metric the ``fedrod`` client sends (declared as sent: ``Outputs`` applies the records' key rule)."""
OUTPUTS = Outputs("FedRoD (strategy)", {
    KEY: Metric("personalised accuracy on the clients' own data (last local epoch)", (KEY,), "%", better="higher"),
}, curves=(KEY,))
"""The clients' ``fedrod-personal-accuracy``, averaged (by examples) like every client metric."""


@STRATEGIES.register("fedrod", FedAvgConfig, pairs_with=("fedrod",), outputs=OUTPUTS)
def fedrod(params: FedAvgConfig, ctx: StrategyContext) -> WeightedFedAvg:
    return WeightedFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)
