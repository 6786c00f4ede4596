"""FedLC (Zhang et al. 2022, "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML): local training on logits shifted by the client's label counts.

The loss is cross-entropy of ``logits_c - tau * n_c^(-1/4)`` where n_c is the number of
local samples of class c (``min_count`` for an absent class, as in the authors' code).
Rare and absent classes get their logits lowered during training only, so the model need
not push them down itself; the returned model is used without calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient


@dataclass
class FedLCConfig:
    tau: float = field(default=1.0, metadata={"ge": 0.0})
    """Calibration strength; 0 is plain cross-entropy."""
    min_count: float = field(default=1e-8, metadata={"gt": 0.0})
    """Count used for classes the client does not hold."""


@CLIENTS.register("fedlc", FedLCConfig)
class FedLCClient(FedMechClient):
    """Plain local training with FedLC's calibrated cross-entropy; works with any strategy."""

    def __init__(self, params: FedLCConfig, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        counts = torch.bincount(self.data.y, minlength=self.data.num_classes).double()
        self.shift = (params.tau * counts.clamp_min(params.min_count).pow(-0.25)).float()

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().loss(logits - self.shift.to(logits.device), y)
