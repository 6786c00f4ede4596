"""FedDecorr (Shi et al. 2023, ICLR, arXiv:2210.00226, "Towards Understanding and
Mitigating Dimensional Collapse in Heterogeneous Federated Learning").

Under label skew, local training collapses the representations into few dimensions and the
global model inherits the collapse. FedDecorr regularises local training towards
decorrelated feature dimensions:

    loss = CE(logits, y) + beta * L_decorr,    L_decorr = (1 / d^2) ||K||_F^2,

where K = Z^T Z / N is the correlation matrix of the batch's penultimate features
z [N, d], each dimension standardised over the batch: Z = (z - mean) / sqrt(var + eps)
(population variance, eps = 1e-8). L_decorr lies in [1/d, 1]: 1/d when the dimensions are
uncorrelated (K = I), 1 when they are all perfectly correlated (every |K_ij| = 1).

beta defaults to 0.1, the coefficient of the authors' code and run scripts. Their code
computes the term differently: the mean of the squared off-diagonal entries of Z^T Z
(not divided by N, unbiased variance), divided by N, about N d / (d - 1) times the
paper's term less its constant 1/d. Their beta = 0.1 therefore weighs the term about N
(the batch size) times more than beta = 0.1 does here, where the paper's formula is used.
Works with any strategy; strategy ``feddecorr`` is FedAvg under the method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient

EPS = 1e-8
"""Added to each dimension's variance before dividing (the authors' code's eps)."""


@dataclass
class FedDecorrConfig:
    beta: float = field(default=0.1, metadata={"ge": 0.0})
    """Weight of the decorrelation term; 0 is FedAvg's local training."""


def decorrelation_loss(features: torch.Tensor) -> torch.Tensor:
    """L_decorr = ||K||_F^2 / d^2 of a batch of features [N, d], K their correlation matrix
    over the batch."""
    n, d = features.shape
    z = features - features.mean(dim=0)
    z = z / torch.sqrt(z.pow(2).mean(dim=0) + EPS)
    k = z.T @ z / n
    return k.pow(2).sum() / d**2


@CLIENTS.register("feddecorr", FedDecorrConfig)
class FedDecorrClient(FedMechClient):
    """Cross-entropy plus beta * L_decorr of each batch's penultimate features. Reports
    ``feddecorr-loss``: L_decorr averaged over the round's samples (1/d: no collapse)."""

    params: FedDecorrConfig

    def __init__(self, params: FedDecorrConfig, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._decorr_sum, self._seen = 0.0, 0

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.model.forward_features(x)
        logits = self.model.forward_head(features)
        decorr = decorrelation_loss(features)
        self._decorr_sum += decorr.detach() * len(y)
        self._seen += len(y)
        return self.loss(logits, y) + self.params.beta * decorr, logits

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        metrics["feddecorr-loss"] = float(self._decorr_sum / max(self._seen, 1))
        return weights, num_examples, metrics
