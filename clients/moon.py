"""MOON, model-contrastive federated learning (Li, He and Song 2021, CVPR, arXiv:2103.16257).

Local loss: l = CE(logits, y) + mu * l_con, with

    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

where sim is the cosine similarity, z the representation of the model being trained,
z_glob that of the global model it received (frozen) and z_prev that of this client's
model from its previous round (frozen), all on the same batch; l_con is averaged over the
batch. It pulls the local representation towards the global model's and pushes it away
from the client's last local model.

Differences from the paper:
- z is the penultimate feature vector (``model.forward_features``, what the head reads).
  The paper adds a projection head (a 2-layer MLP, 256 outputs in its code) between the
  body and the classifier and contrasts its outputs; fedmech models have no such head.
- The previous local model is the client's state (``FedMechClient.state``: the weights its
  ``fit`` returned last time it trained). In the client's first round it has none and the
  contrastive term is left out, which the client reports (``moon-contrasted``: 1 when the
  term was applied, 0 when it was left out). The authors' code does the same in round 1:
  its pool of previous models is empty, so the contrastive logits have a single column
  (the positive pair) and the term is a cross-entropy over one class, 0 with no gradient.
  A client sampled for the first time later (``federation.clients_per_round``) contrasts
  there with its own never-trained initial model; here it leaves the term out, and says so.

mu defaults to 1 and tau to 0.5, the defaults of the authors' code; the paper tunes mu in
{0.1, 1, 5, 10} and reports mu = 5 on CIFAR-10 and 1 on CIFAR-100 and Tiny-ImageNet.
The server side is FedAvg (strategy ``moon``, or ``fedavg``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedmech_flwr.api._builtin import load_model_arrays
from fedmech_flwr.api.client import CLIENTS, FedMechClient
from fedmech_flwr.api.model import FedMechModel


@dataclass
class MoonConfig:
    mu: float = field(default=1.0, metadata={"ge": 0.0})
    """Weight of the model-contrastive term; 0 is FedAvg's local training. The paper reports
    5 on CIFAR-10, 1 on CIFAR-100 and Tiny-ImageNet."""
    temperature: float = field(default=0.5, metadata={"gt": 0.0})
    """tau, the temperature of the contrastive term (the paper's 0.5)."""


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's l_con of a batch of representations [N, d], averaged over the batch: the
    cross-entropy of the logits [sim(z, z_glob), sim(z, z_prev)] / tau for the first."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def _frozen(model: FedMechModel) -> FedMechModel:
    copied = copy.deepcopy(model).eval()
    copied.requires_grad_(False)
    return copied


@CLIENTS.register("moon", MoonConfig)
class MoonClient(FedMechClient):
    """Cross-entropy plus mu * l_con; keeps the weights it returns as its state (the next
    round's previous model). Reports ``moon-contrastive-loss``, l_con averaged over the
    round's samples, and ``moon-contrasted``, whether it had a previous model and applied
    the term (1) or not (0: its first round; the loss is then 0)."""

    params: MoonConfig

    def set_parameters(self, parameters: list[np.ndarray]) -> None:
        """Load the global weights and keep frozen copies of the global model and, from the
        state, of the previous local model (None in the client's first round)."""
        super().set_parameters(parameters)
        self.global_model = _frozen(self.model)
        self.previous = None
        if self.state:
            self.previous = _frozen(self.model)
            load_model_arrays(self.previous, self.state)
        self._contrastive_sum, self._seen = 0.0, 0

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.model.forward_features(x)
        logits = self.model.forward_head(z)
        loss = self.loss(logits, y)
        if self.previous is None:
            return loss, logits
        with torch.no_grad():
            z_glob = self.global_model.forward_features(x)
            z_prev = self.previous.forward_features(x)
        contrastive = model_contrastive_loss(z, z_glob, z_prev, self.params.temperature)
        self._contrastive_sum += contrastive.detach() * len(y)
        self._seen += len(y)
        return loss + self.params.mu * contrastive, logits

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        metrics["moon-contrastive-loss"] = float(self._contrastive_sum / self._seen) if self._seen else 0.0
        metrics["moon-contrasted"] = float(self.previous is not None)
        self.state = {k: np.array(w, copy=True) for k, w in zip(self.model.state_dict(), weights)}
        return weights, num_examples, metrics
