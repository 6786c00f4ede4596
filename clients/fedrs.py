"""FedRS, federated learning with restricted softmax (Li and Zhan 2021, KDD, "FedRS:
Federated Learning with Restricted Softmax for Label Distribution Non-IID Data").

A client that holds no sample of class c has no reason to raise c's score, yet plain
cross-entropy pushes every absent class's weight w_c away from the client's features, and
averaging carries those updates into the global head. FedRS trains on restricted logits

    o_c = alpha_c * w_c^T h + b_c,    alpha_c = 1 if the client holds class c, else alpha,

with alpha in [0, 1] (h the penultimate features, w_c the head's row of class c), so the
absent classes' scores, and the gradients that reach their weights, are damped. The
returned model is used as it is. The paper's logits have no bias; the model's bias b_c is
added unscaled. Which classes a client holds is read from its whole shard. The authors'
code (FedRepo) also has a graded variant, alpha_c = alpha + (1 - alpha) n_c / max_k n_k;
this is the paper's rule. alpha defaults to 0.5 (the authors' code sweeps 0.9, 0.5, 0.1).
A client that holds every class (or alpha = 1) has every scale 1 and trains as the plain
client does, on the model's own logits (its ``F.linear``), so that an IID federation ends
bitwise as FedAvg's. Works with any strategy; strategy ``fedrs`` is FedAvg under the
method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient


@dataclass
class FedRSConfig:
    alpha: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    """Scale of w_c^T h for the classes the client holds no sample of; 1 is plain
    cross-entropy, 0 leaves those classes out of the softmax's scores (bias aside)."""


def restricted_logits(
    features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor
) -> torch.Tensor:
    """o_c = scale_c * w_c^T h + b_c for features h [N, d], weight [K, d], scale [K]."""
    logits = (features @ weight.T) * scale
    return logits if bias is None else logits + bias


@CLIENTS.register("fedrs", FedRSConfig)
class FedRSClient(FedMechClient):
    """Local training on restricted logits; the train accuracy it reports is the model's
    own (unrestricted) prediction."""

    def __init__(self, params: FedRSConfig, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        held = torch.bincount(self.data.y, minlength=self.data.num_classes) > 0
        self.scale = torch.where(held, 1.0, params.alpha).to(self.data.x.device)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if bool((self.scale == 1).all()):  # nothing restricted: the plain client's path, bit for bit
            return super().objective(x, y)
        features = self.model.forward_features(x)
        head = self.model.get_classifier()
        restricted = restricted_logits(features, head.weight, head.bias, self.scale)
        return self.loss(restricted, y), head(features).detach()
