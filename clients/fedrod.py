"""The FedRoD client (Chen & Chao 2022, "On Bridging Generic and Personalized Federated
Learning for Image Classification", ICLR, arXiv:2107.00778): two heads on one body.

The model's own head is the generic head (G-head, psi), averaged with the body (theta) by
the server; the client also keeps a personal head (P-head, phi_m), a Linear(feature_dim,
K), that never leaves the node. With f = f(x; theta) the features, g = h(f; psi) the generic
logits, n_c the client's count of class c (``min_count`` for an absent class, as FedLC's
client does) and CE the cross-entropy, each batch takes two steps (the paper's
Algorithm 1):

    theta, psi <- theta, psi - lr grad_{theta, psi} L_BSM,   L_BSM = CE(g + log n, y)
    phi_m      <- phi_m - lr grad_{phi_m} L_P,               L_P = CE(g + h(f; phi_m), y)

L_BSM is the balanced softmax loss (Ren et al. 2020): the generic head learns the
class-balanced risk whatever the client's label skew. L_P is the empirical risk of the
personalised prediction g + h(f; phi_m) (the P-head learns a residual on top of the generic
logits); its gradient reaches phi_m only (f and g are detached), so the P-head never moves
the body or the G-head. Both steps use ``train``'s optimiser and learning rate (a fresh
optimiser each round for each); the P-head is not pruned.

The P-head starts at zeros at the client's first round (the personalised prediction then
equals the generic one), and lives in the client's state (``personal-head.weight``,
``personal-head.bias``). The public implementations (PFLlib, FL-bench, fluke) start it as a
copy of the first generic head received instead.

Metric: ``fedrod-personal-accuracy``, the personalised prediction's accuracy on the round's
data over the last local epoch (each batch scored before its step); ``train-accuracy`` and
``train-loss`` are the generic head's (its plain logits, and L_BSM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmech_flwr.api._builtin import make_optimizer
from fedmech_flwr.api.client import CLIENTS, FedMechClient

PERSONAL_ACCURACY = "fedrod-personal-accuracy"
PERSONAL_HEAD = "personal-head"
"""The P-head's name in the client's state: ``personal-head.weight``, ``personal-head.bias``."""


@dataclass
class FedRoDConfig:
    min_count: float = field(default=1e-8, metadata={"gt": 0.0})
    """Count used for classes the client does not hold, in log n_c."""


@CLIENTS.register("fedrod", FedRoDConfig, pairs_with=("fedrod",))
class FedRoDClient(FedMechClient):
    """Generic head and body on the balanced softmax loss; the personal head, from the
    client's state, on the personalised prediction's cross-entropy."""

    def __init__(self, params: FedRoDConfig, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        counts = torch.bincount(self.data.y, minlength=self.data.num_classes).double()
        self.log_counts = counts.clamp_min(params.min_count).log().float()
        generic = self.model.get_classifier()
        self.personal = nn.Linear(generic.in_features, generic.out_features).to(self.data.x.device)
        with torch.no_grad():
            for name, p in self.personal.named_parameters():
                saved = self.state.get(f"{PERSONAL_HEAD}.{name}")
                p.copy_(torch.tensor(saved) if saved is not None else torch.zeros_like(p))
        self.personal_optimizer = make_optimizer(self.personal.parameters(), self.train)
        self.round_size = 0
        self.personal_correct = self.personal_seen = 0

    def round_data(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().round_data(generator)
        self.round_size = len(y)
        return x, y

    def balanced_softmax(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """L_BSM: the cross-entropy of ``logits + log n``."""
        return F.cross_entropy(logits + self.log_counts.to(logits.device), y)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the P-head's step on L_P; returns L_BSM and the generic logits, which the
        training loop steps the body and the G-head on."""
        features = self.model.forward_features(x)
        logits = self.model.forward_head(features)
        personalised = logits.detach() + self.personal(features.detach())
        self.personal_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(personalised, y).backward()
        self.personal_optimizer.step()
        if self.personal_seen == self.round_size:  # a new epoch: score only the last
            self.personal_correct = self.personal_seen = 0
        self.personal_correct += int((personalised.detach().argmax(1) == y).sum())
        self.personal_seen += len(y)
        return self.balanced_softmax(logits, y), logits

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        self.state = {f"{PERSONAL_HEAD}.{k}": v.detach().cpu().numpy().astype(np.float32)
                      for k, v in self.personal.state_dict().items()}
        metrics[PERSONAL_ACCURACY] = self.personal_correct / max(self.personal_seen, 1)
        return weights, num_examples, metrics
