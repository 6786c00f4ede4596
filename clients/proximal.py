"""The FedProx client (Li et al. 2020, arXiv:1812.06127): cross-entropy plus
(mu / 2) ||w - w_global||^2 over all trainable parameters, with mu from the server."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient


@CLIENTS.register("proximal", pairs_with=("fedprox",))
class ProximalClient(FedMechClient):
    """Reads ``proximal-mu`` from the train config that the ``fedprox`` strategy sends."""

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        if "proximal-mu" not in config:
            raise RuntimeError("the proximal client needs 'proximal-mu' in the train config; use strategy fedprox")
        self.mu = float(config["proximal-mu"])
        return super().fit(parameters, config)

    def set_parameters(self, parameters: list[np.ndarray]) -> None:
        """Load the global weights and keep a copy: the anchor ``w_global`` of the proximal term."""
        super().set_parameters(parameters)
        self.anchor = [p.detach().clone() for p in self.model.parameters()]

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        proximal = sum((p - a).pow(2).sum() for p, a in zip(self.model.parameters(), self.anchor))
        return super().loss(logits, y) + 0.5 * self.mu * proximal
