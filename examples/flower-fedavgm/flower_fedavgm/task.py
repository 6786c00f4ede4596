"""The app's own model, data and local training.

The model is fedmech's registered SimpleCNN, a ``FedMechModel``: the diagnostics read its
features, head and gated layers through that contract. The data comes from fedmech's
dataset loader and Dirichlet partitioner, and every random stream is seeded with
fedmech's rule (``seed_for``), so a ``fedmech run`` of the same settings trains bitwise
the same models (``tests/test_flower_app.py`` compares the two). Replace any of it with
your own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from torch import nn

from fedmech_flwr.api import seed_for
from fedmech_flwr.api.model import FedMechModel, build_model
from fedmech_flwr.datasets.data import FashionMNISTConfig, SyntheticConfig, load_dataset
from fedmech_flwr.datasets.partition import DirichletConfig, partition_dataset
from fedmech_flwr.learning.training import seed_everything
from fedmech_flwr.models.simple_cnn import SimpleCNNConfig
from fedmech_flwr.spec.experiment import balanced_indices

DATASETS = {
    "fashion_mnist": ("fashion_mnist", FashionMNISTConfig(), SimpleCNNConfig(channels=[32, 64, 128])),
    # the smoke experiment's set and model: 300 + 100 images of 4 classes, 12x12 pixels
    "synthetic": ("synthetic", SyntheticConfig(num_train=300, num_test=100, num_classes=4, image_size=12),
                  SimpleCNNConfig(channels=[4, 8])),
}


@dataclass(frozen=True)
class Federation:
    """The data of one run: the clients' shards, the server's audit and test sets."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    shards: list[np.ndarray]
    """Training-set indices of each partition."""
    audit: np.ndarray
    """Training-set indices held out from every client: ``audit_per_class`` of each class."""
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def shard(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(self.shards[partition_id])
        return self.x_train[idx], self.y_train[idx]

    def audit_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(self.audit)
        return self.x_train[idx], self.y_train[idx]


@cache
def load_federation(dataset: str, num_partitions: int, alpha: float, audit_per_class: int, seed: int) -> Federation:
    """The audit set (drawn first, per class) and a Dirichlet(alpha) split of the rest."""
    name, params, _ = DATASETS[dataset]
    data = load_dataset(name, params)
    labels = data.y_train.numpy()
    audit = balanced_indices(labels, data.num_classes, audit_per_class, seed)
    rest = np.setdiff1d(np.arange(len(labels)), audit)
    parts = partition_dataset("dirichlet", DirichletConfig(alpha=alpha), labels[rest], num_partitions, seed)
    return Federation(data.x_train, data.y_train, [rest[p] for p in parts], audit, data.x_test, data.y_test,
                      data.num_classes)


def make_model(dataset: str, seed: int) -> FedMechModel:
    """A fresh SimpleCNN for ``dataset``, with seeded initial weights."""
    name, params, model = DATASETS[dataset]
    data = load_dataset(name, params)
    seed_everything(seed_for(seed, "model-init"))
    _, channels, size, _ = data.x_train.shape
    return build_model("simple_cnn", model, in_channels=channels, num_classes=data.num_classes, image_size=size)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, batch_size: int,
          seed: int) -> float:
    """Plain SGD (momentum 0.9) on shuffled mini-batches; returns the mean training loss."""
    generator = seed_everything(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    return total / max(seen, 1)
