"""FedAvg (McMahan et al. 2017, arXiv:1602.05629), weighted by examples or uniform.

The client must return its weights and ``num-examples`` in the reply's MetricRecord. The
strategy class, ``WeightedFedAvg``, is the core's (``fedmech_flwr.api``): most strategies
subclass it.
"""

from __future__ import annotations

from fedmech_flwr.api import STRATEGIES, FedAvgConfig, WeightedFedAvg, weighted_fedavg

__all__ = ["FedAvgConfig", "WeightedFedAvg", "fedavg"]


STRATEGIES.register("fedavg", FedAvgConfig)(weighted_fedavg)
