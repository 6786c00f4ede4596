"""FedDecorr (Shi et al. 2023, ICLR, arXiv:2210.00226): FedAvg on the server.

FedDecorr changes local training only (client ``feddecorr``: cross-entropy plus the
decorrelation term, see ``clients/feddecorr.py``); its server averages as FedAvg does.
This is FedAvg registered under the method's name, so that ``strategy: feddecorr`` names
the method, refuses a client that would silently train plain FedAvg, and records the
clients' mean decorrelation loss (1/d: uncorrelated features; 1: collapsed to one
direction).
"""

from __future__ import annotations

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api._builtin import weighted_fedavg
from fedmech_flwr.api.strategy import STRATEGIES, FedAvgConfig

OUTPUTS = Outputs("FedDecorr (strategy)", {
    "feddecorr_loss": Metric("FedDecorr ||K||_F^2 / d^2 of the clients' features (mean)", ("feddecorr_loss",),
                             "loss", 3, better="lower"),
}, curves=("feddecorr_loss",))


STRATEGIES.register("feddecorr", FedAvgConfig, pairs_with=("feddecorr",), outputs=OUTPUTS)(weighted_fedavg)
