"""The NumPyClient every client plug-in subclasses, and the client registry.

Users asked for Flower ``NumPyClient``s, so client behaviours are NumPyClient
subclasses: ``fit`` trains on the client's shard with the shared engine and returns
weights as a NumPy list in ``state_dict`` order. A new behaviour (proximal term, logit
calibration, ...) overrides ``loss`` (or ``objective``, when it needs the features, or
``fit``) and registers itself in ``CLIENTS``. ``client_app.py`` adapts these clients to
Flower's Message API.

A client is built afresh for every train message. What it keeps across rounds
(SCAFFOLD's control variate, MOON's previous model) lives in ``state``, which the node
keeps for it (Flower's ``context.state``) and the server copies for a resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from torch import nn

from fedmech_flwr.foundation.registry import Registry
from fedmech_flwr.foundation.seeds import seed_for
from fedmech_flwr.learning.arrays import NamedArrays
from fedmech_flwr.learning.pruning import MagnitudePruner, PruningConfig, layer_sparsity, overall_sparsity
from fedmech_flwr.learning.training import TrainConfig, local_steps, seed_everything, train_epochs
from fedmech_flwr.models import FedMechModel

CLIENTS: Registry[type[FedMechClient]] = Registry("client")


@dataclass
class ClientData:
    """One client's data (a shard, or a node's own), as tensors on the training device."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None
    """A validation split that a node brought with its own data (never from a shard)."""


class FedMechClient(NumPyClient):
    """Local training of one client on its shard, with magnitude pruning.

    The registered class is built as ``cls(params, model=..., data=..., train=...,
    pruning=..., seed=..., partition_id=..., state=..., received=...)`` where ``params`` is
    the plug-in's own validated config. ``fit`` gets the strategy's train config (e.g.
    FedProx's ``proximal-mu``) and always ``config["server-round"]``.
    """

    state: NamedArrays
    """This client's own state across rounds, as ``fit`` left it last time (empty at first).
    ``fit`` may replace it; the node keeps it for the next round and the server keeps a copy
    (the state of each client's last accepted reply) that a resumed run sends back."""
    received: dict[str, NamedArrays]
    """Arrays the strategy sent with the global model, by record name (SCAFFOLD's server
    control variate)."""
    upload: dict[str, NamedArrays]
    """Arrays ``fit`` sends its strategy besides the weights, by name; the strategy reads
    them with ``fedmech_flwr.contracts.strategy.uploaded``."""
    steps: int
    """The optimizer steps the last ``fit`` took (SCAFFOLD's K, FedNova's tau_i)."""

    def __init__(
        self,
        params: Any,
        *,
        model: FedMechModel,
        data: ClientData,
        train: TrainConfig,
        pruning: PruningConfig,
        seed: int,
        partition_id: int,
        state: NamedArrays | None = None,
        received: dict[str, NamedArrays] | None = None,
    ) -> None:
        self.params = params
        self.model = model
        self.data = data
        self.train = train
        self.pruning = pruning
        self.seed = seed
        self.partition_id = partition_id
        self.state = dict(state or {})
        self.received = dict(received or {})
        self.upload = {}

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [v.detach().cpu().numpy() for v in self.model.state_dict().values()]

    def set_parameters(self, parameters: list[np.ndarray]) -> None:
        state = self.model.state_dict()
        if len(parameters) != len(state):
            raise ValueError(f"expected {len(state)} arrays in state_dict order, got {len(parameters)}")
        self.model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(state, parameters)})

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local objective of one batch: what a new client behaviour changes (the default is
        cross-entropy).

        Parameters
        ----------
        logits : torch.Tensor
            The model's output, ``[N, classes]``.
        y : torch.Tensor
            The labels, ``[N]``.

        Returns
        -------
        torch.Tensor
            A scalar loss, which local training minimises.

        Examples
        --------
        >>> class SmoothLabels(FedMechClient):
        ...     def loss(self, logits, y):
        ...         return torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
        """
        return nn.functional.cross_entropy(logits, y)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's ``(loss, logits)``: ``loss`` of the model's logits. A behaviour that needs
        the penultimate features overrides this instead of ``loss`` (MOON, FedDecorr, FedRS).

        Parameters
        ----------
        x : torch.Tensor
            The inputs, ``[N, C, H, W]``.
        y : torch.Tensor
            The labels, ``[N]``.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            The scalar loss and the logits.

        Examples
        --------
        >>> class FeatureNorm(FedMechClient):
        ...     def objective(self, x, y):
        ...         features = self.model.forward_features(x)
        ...         logits = self.model.forward_head(features)
        ...         return self.loss(logits, y) + 1e-3 * features.pow(2).mean(), logits
        """
        logits = self.model(x)
        return self.loss(logits, y), logits

    def round_data(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """This round's training samples: all of them, or a seeded subset."""
        x, y = self.data.x, self.data.y
        cap = self.train.max_samples_per_round
        if cap is not None and cap < len(x):
            idx = torch.randperm(len(x), generator=generator)[:cap].to(x.device)
            x, y = x[idx], y[idx]
        return x, y

    def start_round(self, config: dict[str, Any]) -> None:
        """Called in ``fit`` once the round's global weights are in ``self.model``, before
        local training: where a client takes what it keeps of them (SCAFFOLD's and FedDyn's
        anchor), so that nothing loads them twice. Does nothing here.

        Parameters
        ----------
        config : dict
            The round's train config (``server-round`` and what the strategy sends).
        """

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.set_parameters(parameters)
        self.start_round(config)
        server_round = int(config["server-round"])
        generator = seed_everything(seed_for(self.seed, "local-training", self.partition_id, server_round))
        x, y = self.round_data(generator)
        pruner = None
        if self.pruning.mode == "magnitude":
            pruner = MagnitudePruner(self.model, self.pruning, total_steps=local_steps(len(x), self.train))
        stats = train_epochs(self.model, x, y, self.train, generator, self.objective, pruner)
        self.steps = stats.steps
        metrics = {
            "train-loss": stats.loss,
            "train-accuracy": stats.accuracy,
            "train-seconds": stats.seconds,
            "train-samples-per-s": stats.samples_per_s,
            "sparsity": overall_sparsity(self.model, include_head=self.pruning.include_head),
            "local-per-class-accuracy": json.dumps(stats.per_class_accuracy),
            "layer-sparsity": json.dumps(layer_sparsity(self.model)),
        }
        return self.get_parameters({}), stats.num_examples, metrics
