"""The SCAFFOLD client (Karimireddy et al. 2020, arXiv:1910.06378), option II control variates.

Client i keeps its control variate c_i (``state``, zeros at first). From the server model
x and control variate c it takes K local SGD steps of learning rate eta_l on the corrected
gradient g_i(y) - c_i + c, then (option II, Algorithm 1 line 12)

    c_i+ = c_i - c + (x - y) / (K eta_l)

keeps c_i+ and uploads delta_c_i = c_i+ - c_i. The correction is the loss term
<y - x, c - c_i> over the float parameters (its gradient is c - c_i; the constant <x, c - c_i>
is subtracted so the recorded loss starts at the cross-entropy), so the shared training
loop runs it.

Option II assumes plain SGD, where (x - y) / (K eta_l) is the mean corrected gradient of
the K steps; the strategy refuses any other local optimiser (``strategies.scaffold``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedmech_flwr.api.client import CLIENTS, FedMechClient

CONTROL = "scaffold-c"
"""The ArrayRecord of the train message holding the server's control variate c."""
DELTA_CONTROL = "scaffold-delta-c"
"""What the client uploads: c_i+ - c_i, by parameter name."""


@CLIENTS.register("scaffold", pairs_with=("scaffold",))
class ScaffoldClient(FedMechClient):
    """Local SGD with SCAFFOLD's drift correction; reads ``scaffold-c`` from the message."""

    def start_round(self, config: dict[str, Any]) -> None:
        """The anchor x and the correction c - c_i, from the global weights just loaded."""
        if CONTROL not in self.received:
            raise RuntimeError(f"the scaffold client needs the server control variate '{CONTROL}' in the train "
                               "message; use strategy scaffold")
        params = dict(self.model.named_parameters())
        c = self.received[CONTROL]
        self.c_i = c_i = self.state or {name: np.zeros_like(c[name]) for name in params}
        self.anchor = {name: p.detach().clone() for name, p in params.items()}
        self.correction = {name: torch.tensor(c[name] - c_i[name], device=p.device) for name, p in params.items()}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        weights, num_examples, metrics = super().fit(parameters, config)
        c, c_i = self.received[CONTROL], self.c_i
        scale = 1.0 / (self.steps * self.train.lr)  # 1 / (K eta_l)
        new = {}
        for name, p in self.model.named_parameters():
            moved = (self.anchor[name].double() - p.detach().double()).cpu().numpy()  # x - y
            new[name] = c_i[name].astype(np.float64) - c[name] + moved * scale
        self.upload[DELTA_CONTROL] = {name: (v - c_i[name]).astype(np.float32) for name, v in new.items()}
        self.state = {name: v.astype(np.float32) for name, v in new.items()}
        return weights, num_examples, metrics

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        drift = sum(((p - self.anchor[name]) * self.correction[name]).sum() for name, p in self.model.named_parameters())
        return super().loss(logits, y) + drift
