"""The FedBABU client (Oh et al. 2022, arXiv:2106.06042): local training of the body only;
the head stays as received (at its initialisation, with strategy ``fedbabu``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmech_flwr.api.client import CLIENTS, FedMechClient


@CLIENTS.register("fedbabu", pairs_with=("fedbabu",))
class FedBABUClient(FedMechClient):
    """Freezes the classifier (no gradient, so neither the optimizer nor weight decay
    touches it) before the shared training loop. Pruning leaves the head alone unless
    ``pruning.include_head`` is set, which FedBABU does not allow."""

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        if self.pruning.include_head:
            raise RuntimeError("FedBABU keeps the head at its initialisation; set pruning.include_head=false")
        for p in self.model.get_classifier().parameters():
            p.requires_grad_(False)
        return super().fit(parameters, config)
