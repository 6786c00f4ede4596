"""FedAvg (McMahan et al. 2017, arXiv:1602.05629), weighted by examples or uniform.

The client must return its weights and ``num-examples`` in the reply's MetricRecord. The
strategy class, ``WeightedFedAvg``, is the core's (``fedmech_flwr.api.strategy``): most strategies
subclass it.
"""

from __future__ import annotations

from fedmech_flwr.api._builtin import weighted_fedavg
from fedmech_flwr.api.strategy import STRATEGIES, FedAvgConfig, WeightedFedAvg

__all__ = ["FedAvgConfig", "WeightedFedAvg", "fedavg"]


fedavg = STRATEGIES.register("fedavg", FedAvgConfig)(weighted_fedavg)
