"""The FedNova client (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS, arXiv:2007.07481).

Plain local SGD (momentum rho = ``train.momentum``) for tau_i steps; the client reports
tau_i (``fednova-steps``) and the L1 norm of its aggregation vector a_i
(``fednova-a-norm``), which the ``fednova`` strategy normalises its update by. With
heavy-ball momentum (PyTorch's SGD, no dampening) the displacement after tau steps is
eta sum_k g_k (1 - rho^(tau-k+1)) / (1 - rho), so a_i = [1 - rho^tau, ..., 1 - rho] / (1 - rho),
the paper's local-momentum example, and

    ||a_i||_1 = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)

which is tau for rho = 0 and 1 for tau = 1 (the authors' code accumulates the same number
step by step as ``local_normalizing_vec``); ``a_norm`` computes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmech_flwr.api._builtin import a_norm
from fedmech_flwr.api.client import CLIENTS, FedMechClient

A_NORM = "fednova-a-norm"
"""The client metric holding ||a_i||_1."""
STEPS = "fednova-steps"
"""The client metric holding tau_i, the local steps of the round."""


@CLIENTS.register("fednova", pairs_with=("fednova",))
class FedNovaClient(FedMechClient):
    """Plain local training that reports tau_i and ||a_i||_1 with its weights."""

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        metrics[STEPS] = self.steps
        metrics[A_NORM] = a_norm(self.steps, self.train.momentum)
        return weights, num_examples, metrics
