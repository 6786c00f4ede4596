"""Building blocks shared by the ServerApp and the ClientApp for one experiment config.

Both sides derive the same data, partitions and model from the resolved config and the
seed, so a client can rebuild its shard from its partition-id alone. Decoded datasets and
partitions are cached per process (Ray actors serve many clients); nothing per-client is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch

from fedmech_flwr.arrays import NamedArrays, load_model_arrays
from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.data import DatasetBundle, load_dataset
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.models import FedMechModel, build_model
from fedmech_flwr.partition import partition_dataset
from fedmech_flwr.training import seed_everything
from fedmech_flwr.typed import to_plain

_PARTITIONS: dict[str, list[np.ndarray]] = {}


def load_data(cfg: ExperimentConfig) -> DatasetBundle:
    return load_dataset(cfg.data.dataset.name, cfg.data.dataset.params)


def audit_indices(cfg: ExperimentConfig, bundle: DatasetBundle) -> np.ndarray:
    """Training-set indices of the server's audit set: ``data.audit_per_class`` samples of
    every class, seeded, sorted (empty without an audit set)."""
    per_class = cfg.data.audit_per_class
    labels = bundle.y_train.numpy()
    if per_class == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([cfg.seed, 104729])
    picks = []
    for c in range(bundle.num_classes):
        pool = np.flatnonzero(labels == c)
        if len(pool) <= per_class:
            raise ConfigError(
                f"audit_per_class ({per_class}) must be below the {len(pool)} training samples of class {c}",
                "data.audit_per_class",
            )
        picks.append(rng.choice(pool, size=per_class, replace=False))
    return np.sort(np.concatenate(picks)).astype(np.int64)


def check_disjoint_from_test(audit_x: torch.Tensor, test_x: torch.Tensor) -> None:
    """The audit set must share no image with the test set (byte-identical images are
    found by hash), or every number the server measures on it leaks the test set."""
    if not len(audit_x):
        return
    shared = len(_image_digests(audit_x) & _image_digests(test_x))
    if shared:
        raise ConfigError(
            f"the audit set shares {shared} image(s) with the test set; the dataset's training "
            "split contains test images. Remove them from the training data, or set "
            "data.audit_per_class=0 to run without an audit set",
            "data.audit_per_class",
        )


def _image_digests(x: torch.Tensor) -> set[str]:
    return {hashlib.sha1(image.tobytes()).hexdigest() for image in x.cpu().numpy()}


def client_partitions(cfg: ExperimentConfig, bundle: DatasetBundle) -> list[np.ndarray]:
    """Training-set indices of every client (deterministic in the config and seed); the
    audit set, if any, is held out before partitioning."""
    key = repr((to_plain(cfg.data), cfg.federation.num_clients, cfg.seed))
    if key not in _PARTITIONS:
        part = cfg.data.partition
        available = np.setdiff1d(np.arange(len(bundle.y_train)), audit_indices(cfg, bundle))
        labels = bundle.y_train.numpy()[available]
        parts = partition_dataset(part.name, part.params, labels, cfg.federation.num_clients, cfg.seed)
        _PARTITIONS[key] = [available[p] for p in parts]
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


def model_builder(cfg: ExperimentConfig, bundle: DatasetBundle, device: torch.device) -> Callable[[NamedArrays], FedMechModel]:
    """``build(arrays)``: a fresh model of this experiment holding ``arrays``, in eval mode."""

    def build(arrays: NamedArrays) -> FedMechModel:
        model = new_model(cfg, bundle, device)
        load_model_arrays(model, arrays)
        return model.eval()

    return build
