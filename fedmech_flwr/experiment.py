"""Building blocks shared by the ServerApp and the ClientApp for one experiment config.

Both sides derive the same data, partitions and model from the resolved config and the
seed, so a client can rebuild its shard from its partition-id alone. Decoded datasets and
partitions are cached per process (Ray actors serve many clients); nothing per-client is.
"""

from __future__ import annotations

import numpy as np
import torch

from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.data import DatasetBundle, load_dataset
from fedmech_flwr.models import FedMechModel, build_model
from fedmech_flwr.partition import partition_dataset
from fedmech_flwr.training import seed_everything
from fedmech_flwr.typed import to_plain

_PARTITIONS: dict[str, list[np.ndarray]] = {}


def load_data(cfg: ExperimentConfig) -> DatasetBundle:
    return load_dataset(cfg.data.dataset.name, cfg.data.dataset.params)


def client_partitions(cfg: ExperimentConfig, bundle: DatasetBundle) -> list[np.ndarray]:
    """Training-set indices of every client (deterministic in the config and seed)."""
    key = repr((to_plain(cfg.data), cfg.federation.num_clients, cfg.seed))
    if key not in _PARTITIONS:
        part = cfg.data.partition
        labels = bundle.y_train.numpy()
        _PARTITIONS[key] = partition_dataset(part.name, part.params, labels, cfg.federation.num_clients, cfg.seed)
    return _PARTITIONS[key]


def new_model(cfg: ExperimentConfig, bundle: DatasetBundle, device: torch.device | str = "cpu") -> FedMechModel:
    """The model of this experiment; weights are seeded by ``cfg.seed``."""
    seed_everything(cfg.seed)
    model = build_model(
        cfg.model.name,
        cfg.model.params,
        in_channels=bundle.in_channels,
        num_classes=bundle.num_classes,
        image_size=bundle.image_size,
    )
    return model.to(device)
