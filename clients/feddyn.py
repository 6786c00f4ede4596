"""The FedDyn client (Acar et al. 2021, "Federated Learning Based on Dynamic
Regularization", ICLR, arXiv:2111.04263), Algorithm 1.

Client k keeps h_k = grad L_k(theta_k^{t-1}) (``state``, zeros at first). From the server
model theta^{t-1} it minimises

    L_k(theta) - <h_k, theta> + (alpha / 2) ||theta - theta^{t-1}||^2

(the linear term is written <h_k, theta - theta^{t-1}>: the same gradient, and the recorded
loss starts at the cross-entropy), then sets h_k <- h_k - alpha (theta_k^t - theta^{t-1}).
alpha comes from the ``feddyn`` strategy in the train config (``feddyn-alpha``). Float
parameters only; buffers are trained and returned as usual.

Checked line by line against the authors' code (github.com/alpemreacar/FedDyn,
``train_feddyn_mdl`` and ``train_FedDyn``): the same gradient (theirs writes the quadratic
as weight decay alpha and the linear term as alpha <theta, -theta^{t-1} + sum of the
client's past moves>), the same h_k and server updates. Theirs also clips every gradient at
norm 10 (in every method of that code, FedAvg's too) and scales alpha per client by its
share of the data (alpha / (n_k / mean n)); neither is in the paper's Algorithm 1, nor here.
Their local steps are plain SGD, which the strategy requires.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient

ALPHA = "feddyn-alpha"
"""The train config key the strategy sends alpha under."""


@CLIENTS.register("feddyn", pairs_with=("feddyn",))
class FedDynClient(FedMechClient):
    """Local training on FedDyn's dynamically regularised objective."""

    def start_round(self, config: dict[str, Any]) -> None:
        """The anchor theta^{t-1} and this client's h, from the global weights just loaded."""
        if ALPHA not in config:
            raise RuntimeError(f"the feddyn client needs '{ALPHA}' in the train config; use strategy feddyn")
        self.alpha = float(config[ALPHA])
        params = dict(self.model.named_parameters())
        self.anchor = {name: p.detach().clone() for name, p in params.items()}
        self.h = {name: torch.tensor(self.state[name], device=p.device) if self.state else torch.zeros_like(p.detach())
                  for name, p in params.items()}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        self.state = {name: (self.h[name] - self.alpha * (p.detach() - self.anchor[name])).cpu().numpy()
                      for name, p in self.model.named_parameters()}
        return weights, num_examples, metrics

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        linear, quadratic = 0.0, 0.0
        for name, p in self.model.named_parameters():
            moved = p - self.anchor[name]
            linear = linear + (self.h[name] * moved).sum()
            quadratic = quadratic + moved.pow(2).sum()
        return super().loss(logits, y) - linear + 0.5 * self.alpha * quadratic
