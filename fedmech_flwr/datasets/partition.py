"""Splitting a training set among clients, looked up by name, plus label histograms.

A partitioner maps ``(labels, num_clients, cfg, seed)`` to one sorted int64 array of
training-set indices per client. All randomness comes from ``seed``, so the same
config and seed always give the same split.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.registry import Registry

log = logging.getLogger(__name__)

Partitioner = Callable[[np.ndarray, int, Any, int], list[np.ndarray]]
PARTITIONERS: Registry[Partitioner] = Registry("partition")


def partition_dataset(
    name: str, cfg: Any, labels: np.ndarray, num_clients: int, seed: int
) -> list[np.ndarray]:
    """Split ``labels``' indices among ``num_clients`` with partitioner ``name``.

    Checks the result: one array per client, indices in range, disjoint, none empty.
    """
    labels = np.asarray(labels)
    if num_clients < 1 or num_clients > len(labels):
        raise ConfigError(
            f"num_clients must be between 1 and the number of training samples "
            f"({len(labels)}), got {num_clients}",
            "federation.num_clients",
        )
    parts = PARTITIONERS.get(name).factory(labels, num_clients, cfg, seed)
    if len(parts) != num_clients:
        raise RuntimeError(f"partition '{name}' returned {len(parts)} parts for {num_clients}")
    flat = np.concatenate(parts)
    if len(flat) and (flat.min() < 0 or flat.max() >= len(labels)):
        raise RuntimeError(f"partition '{name}' returned indices outside 0..{len(labels) - 1}")
    if len(np.unique(flat)) != len(flat):
        raise RuntimeError(f"partition '{name}' gave some samples to several clients")
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(
            f"partition '{name}' left client(s) {empty} without samples; use fewer clients "
            f"or change the partition's parameters",
            "data.partition",
        )
    sizes = [len(p) for p in parts]
    log.info(
        "partition '%s': %d clients hold %d of %d samples, %d..%d each",
        name, num_clients, len(flat), len(labels), min(sizes), max(sizes),
    )
    return parts


def _sorted(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _split_classes(
    labels: np.ndarray, holders: dict[int, list[int]], num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffle each class's indices and split them evenly among the clients holding it."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, clients in sorted(holders.items()):
        idx = rng.permutation(np.flatnonzero(labels == c))
        for client, chunk in zip(clients, np.array_split(idx, len(clients))):
            parts[client].append(chunk)
    return _sorted([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])


@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, cfg: Any, seed: int) -> list[np.ndarray]:
    """Shuffle, then split into parts whose sizes differ by at most one."""
    perm = np.random.default_rng(seed).permutation(len(labels))
    return _sorted(np.array_split(perm, num_clients))


@dataclass
class DirichletConfig:
    alpha: float = field(default=0.5, metadata={"gt": 0})
    """Concentration: small (0.05) gives each client few classes, large (1e6) near-iid."""
    min_samples: int = field(default=10, metadata={"ge": 0})
    """Redraw until every client has at least this many samples."""
    max_attempts: int = field(default=100, metadata={"ge": 1})
    """Give up after this many draws."""


@PARTITIONERS.register("dirichlet", DirichletConfig)
def dirichlet(
    labels: np.ndarray, num_clients: int, cfg: DirichletConfig, seed: int
) -> list[np.ndarray]:
    """Label skew: for each class, draw client shares ~ Dir(alpha) and cut that class's
    shuffled indices by them. Every sample goes to some client."""
    if cfg.min_samples * num_clients > len(labels):
        raise ConfigError(
            f"dirichlet: {num_clients} clients x min_samples={cfg.min_samples} needs more "
            f"than the {len(labels)} samples there are; lower min_samples or use fewer clients",
            "data.partition.min_samples",
        )
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    best = 0
    for _ in range(cfg.max_attempts):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            shares = rng.dirichlet(np.full(num_clients, cfg.alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        smallest = min(sum(len(c) for c in p) for p in parts)
        if smallest >= cfg.min_samples:
            return _sorted([np.concatenate(p) for p in parts])
        best = max(best, smallest)
    raise ConfigError(
        f"dirichlet: no draw in {cfg.max_attempts} attempts gave every client "
        f"min_samples={cfg.min_samples} (the best draw's smallest client had {best}); "
        f"raise alpha (now {cfg.alpha}), lower min_samples, or use fewer clients",
        "data.partition.alpha",
    )


@dataclass
class ClassesPerClientConfig:
    k: int = field(default=2, metadata={"ge": 1})
    """Number of distinct classes each client holds."""


@PARTITIONERS.register("classes_per_client", ClassesPerClientConfig)
def classes_per_client(
    labels: np.ndarray, num_clients: int, cfg: ClassesPerClientConfig, seed: int
) -> list[np.ndarray]:
    """Each client holds ``k`` classes, dealt round-robin from a seeded permutation of the
    classes (so all are used when num_clients * k >= num_classes); each class's samples are
    split evenly among its holders. Classes dealt to nobody are unused."""
    classes = np.unique(labels)
    if cfg.k > len(classes):
        raise ConfigError(f"k must be <= the number of classes ({len(classes)}), got {cfg.k}", "data.partition.k")
    rng = np.random.default_rng(seed)
    order = rng.permutation(classes)
    holders: dict[int, list[int]] = {}
    for client in range(num_clients):
        for j in range(cfg.k):
            holders.setdefault(int(order[(client * cfg.k + j) % len(classes)]), []).append(client)
    return _split_classes(labels, holders, num_clients, rng)


@dataclass
class ClassMapConfig:
    classes: dict[int, list[int]]
    """Partition id -> the classes it holds, e.g. {0: [0], 1: [3], 2: [6]}. Keys must be
    exactly 0..num_clients-1. A class held by several clients is split evenly among them;
    samples of classes nobody holds are left out of the federation."""


@PARTITIONERS.register("class_map", ClassMapConfig)
def class_map(
    labels: np.ndarray, num_clients: int, cfg: ClassMapConfig, seed: int
) -> list[np.ndarray]:
    """An explicit client -> classes assignment (controlled splits)."""
    missing = sorted(set(range(num_clients)) - set(cfg.classes))
    extra = sorted(set(cfg.classes) - set(range(num_clients)))
    if missing or extra:
        raise ConfigError(
            f"classes must name exactly clients 0..{num_clients - 1} (federation.num_clients is "
            f"{num_clients}); missing {missing}, extra {extra}",
            "data.partition.classes",
        )
    num_classes = int(labels.max()) + 1
    holders: dict[int, list[int]] = {}
    for client, held in sorted(cfg.classes.items()):
        for c in sorted(set(held)):
            if not 0 <= c < num_classes:
                raise ConfigError(f"client {client}: class {c} is outside 0..{num_classes - 1}",
                                  f"data.partition.classes.{client}")
            holders.setdefault(c, []).append(client)
    return _split_classes(labels, holders, num_clients, np.random.default_rng(seed))


def label_histograms(
    parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int
) -> np.ndarray:
    """Per-client label counts, int64 [num_clients, num_classes]."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])
