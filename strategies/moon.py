"""MOON (Li, He and Song 2021, CVPR, arXiv:2103.16257): FedAvg on the server.

MOON changes local training only (client ``moon``: cross-entropy plus the model-contrastive
term, see ``clients/moon.py``); its server averages as FedAvg does. This is FedAvg
registered under the method's name, so that ``strategy: moon`` names the method, refuses
a client that would silently train plain FedAvg, and records the clients' mean
contrastive loss and the share of them that applied it (a client without a previous
model, in its first round, leaves the term out).
"""

from __future__ import annotations

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api._builtin import weighted_fedavg
from fedmech_flwr.api.strategy import STRATEGIES, FedAvgConfig

OUTPUTS = Outputs("MOON (strategy)", {
    "moon_contrastive_loss": Metric("MOON contrastive loss l_con (clients' mean)", ("moon_contrastive_loss",),
                                    "loss", 3),
    "moon_contrasted": Metric("share of clients (by examples) that had a previous model and applied l_con",
                              ("moon_contrasted",), "%"),
}, curves=("moon_contrastive_loss", "moon_contrasted"))


STRATEGIES.register("moon", FedAvgConfig, pairs_with=("moon",), outputs=OUTPUTS)(weighted_fedavg)
