"""FedProx (Li et al. 2020, arXiv:1812.06127), the standard non-IID baseline.

Flower's own ``FedProx`` (it sends ``proximal-mu`` in every train config) with fedmech's
dtype-preserving average. The client must be ``proximal``: it adds
(mu / 2) ||w - w_global||^2 to its loss; any other client would silently train FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.serverapp.strategy import FedProx

from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, FedAvgConfig, StrategyContext, WeightedFedAvg


@dataclass
class FedProxConfig(FedAvgConfig):
    proximal_mu: float = field(default=0.01, metadata={"ge": 0.0})
    """Weight mu of the proximal term; 0 is FedAvg."""


class WeightedFedProx(FedProx, WeightedFedAvg):
    """Flower's FedProx ``configure_train`` with ``WeightedFedAvg.aggregate_train``."""

    def __init__(self, proximal_mu: float, weighting: str = "examples", **kwargs) -> None:
        super().__init__(proximal_mu=proximal_mu, **kwargs)
        self.weighting = weighting


@STRATEGIES.register("fedprox", FedProxConfig, pairs_with=("proximal",))
def fedprox(params: FedProxConfig, ctx: StrategyContext) -> WeightedFedProx:
    return WeightedFedProx(params.proximal_mu, weighting=params.weighting, **OFFERED_NODES_ONLY)
