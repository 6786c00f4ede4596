"""The FedETF client (Li et al. 2023, ICCV, arXiv:2303.10058): the body trained under a
fixed simplex-ETF head (strategy ``fedetf`` sends it and keeps it in every aggregate).

Local loss: cross-entropy of the ETF logits

    l_c = w_c^T h / (T ||h||) + log n_c,

with h the penultimate features, w_c the ETF's class vector (the frozen head's row c), T
the temperature and, with ``balanced`` (the paper's balanced loss, Ren et al. 2020's
balanced softmax), log n_c of the client's n_c samples of class c (n_c = 1 for a class it
holds none of, as the authors' code sets). The head is frozen (no gradient, so neither
the optimizer nor weight decay moves it).

The paper normalises the output of a projection layer and learns the temperature (its
code's 1/T starts at 10 for its CIFAR CNN, as a model parameter that is averaged); here h
is the model's own penultimate features and T is fixed, default 0.1 (1/T = 10).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig
from fedmech_flwr.api.client import CLIENTS, FedMechClient


@dataclass
class ETFConfig:
    temperature: float = field(default=0.1, metadata={"gt": 0.0})
    """T of the logits w_c^T h / (T ||h||) (the paper learns it; its code starts 1/T at 10)."""
    balanced: bool = True
    """Add log n_c to the logits while training (the paper's balanced loss); false: plain
    cross-entropy."""


def etf_logits(features: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """w_c^T h / (T ||h||) for features h [N, d] and class vectors weight [K, d]."""
    return F.normalize(features, dim=1) @ weight.T / temperature


def check_etf_client(params: ETFConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    if cfg.pruning.include_head:
        raise ConfigError("client etf keeps the head at the simplex ETF, which pruning it would break; "
                          "set pruning.include_head=false", where)


@CLIENTS.register("etf", ETFConfig, pairs_with=("fedetf",), check=check_etf_client)
class ETFClient(FedMechClient):
    """Freezes the head before the shared training loop; trains on the ETF logits."""

    params: ETFConfig

    def __init__(self, params: ETFConfig, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        counts = torch.bincount(self.data.y, minlength=self.data.num_classes).clamp_min(1)
        self.shift = counts.double().log().float() if params.balanced else torch.zeros(len(counts))

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.model.get_classifier().requires_grad_(False)
        return super().fit(parameters, config)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = etf_logits(self.model.forward_features(x), self.model.get_classifier().weight, self.params.temperature)
        return self.loss(logits + self.shift.to(logits.device), y), logits
