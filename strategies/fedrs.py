"""FedRS (Li and Zhan 2021, KDD, "FedRS: Federated Learning with Restricted Softmax for
Label Distribution Non-IID Data"): FedAvg on the server.

FedRS changes local training only (client ``fedrs``: cross-entropy of restricted logits,
see ``clients/fedrs.py``); its server averages as FedAvg does. This is FedAvg registered
under the method's name, so that ``strategy: fedrs`` names the method and refuses a
client that would silently train plain FedAvg.
"""

from __future__ import annotations

from fedmech_flwr.api._builtin import weighted_fedavg
from fedmech_flwr.api.strategy import STRATEGIES, FedAvgConfig


STRATEGIES.register("fedrs", FedAvgConfig, pairs_with=("fedrs",))(weighted_fedavg)
