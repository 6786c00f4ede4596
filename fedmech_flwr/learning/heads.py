"""Head-level algorithms shared by diagnostics and strategies.

Everything here works on a model's frozen penultimate features (``forward_features`` in
eval mode, so BatchNorm statistics stay frozen too). Finetuning only the head is then
exactly training a linear layer on cached features, starting from the current head:

- ``features_at`` / ``features``: frozen penultimate features of a model and of named
  gated layers (average-pooled), in one forward pass;
- ``train_linear``: a linear layer trained with AdamW, one snapshot per epoch, so the
  caller selects the epoch on a split of its choice (validation, or the test set when
  reproducing a protocol that did);
- ``ClassStats``: per-class feature counts, sums and second moments, the sufficient
  statistics clients send for data-free realignment (summed over clients exactly);
- ``ncm_head`` (nearest class mean), ``virtual_features`` (CCVR's class Gaussians),
  ``ccvr_head`` (a head retrained on them) and ``tau_normalize`` (tau-normalised class
  weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.training import channels_last, channels_last_copy, largest_predicted_class, recall
from fedmech_flwr.models import FedMechModel

Covariance = Literal["diagonal", "full"]


@torch.no_grad()
def features_at(
    model: FedMechModel, x: Tensor, layers: Sequence[str] = (), batch_size: int = 1000
) -> tuple[Tensor, dict[str, Tensor]]:
    """Frozen penultimate features of ``x`` and the outputs of the gated ``layers``
    (averaged over space when a feature map), all from one forward pass. Float32, ``[N, D]``."""
    model = channels_last_copy(model).eval()
    captured: dict[str, list[Tensor]] = {name: [] for name in layers}

    def keep(name: str):
        def hook(_module, _inputs, out: Tensor) -> None:
            captured[name].append((out.mean(dim=(2, 3)) if out.dim() == 4 else out).float())

        return hook

    handles = [model.layer_module(name).register_forward_hook(keep(name)) for name in captured]
    try:
        chunks = [model.forward_features(channels_last(x[i : i + batch_size])).float()
                  for i in range(0, len(x), batch_size)]
    finally:
        for handle in handles:
            handle.remove()
    widths = model.gated_layers()
    penultimate = torch.cat(chunks) if chunks else torch.empty(0, model.feature_dim)
    return penultimate, {name: torch.cat(c) if c else torch.empty(0, widths[name]) for name, c in captured.items()}


def features(model: FedMechModel, x: Tensor, layer: str | None = None, batch_size: int = 1000) -> Tensor:
    """Frozen features of ``x``: penultimate (``layer=None``) or of gated layer ``layer``
    (see ``features_at``)."""
    penultimate, at = features_at(model, x, () if layer is None else (layer,), batch_size)
    return penultimate if layer is None else at[layer]


@dataclass
class LinearHead:
    """A linear classifier ``logits = f @ weight.T + bias``."""

    weight: Tensor
    bias: Tensor

    @classmethod
    def of(cls, model: FedMechModel) -> LinearHead:
        head = model.get_classifier()
        return cls(head.weight.detach().clone(), head.bias.detach().clone())

    def predict(self, f: Tensor) -> Tensor:
        return (f @ self.weight.T + self.bias).argmax(1)

    def install(self, layer: nn.Linear) -> None:
        """Copy this head into ``layer`` (in place), e.g. ``model.get_classifier()``."""
        with torch.no_grad():
            layer.weight.copy_(self.weight)
            layer.bias.copy_(self.bias)


@dataclass
class Scores:
    accuracy: float
    per_class_accuracy: list[float | None]
    """Recall of each class; None for a class absent from the evaluated set."""
    max_predicted_class: int
    """The class predicted most often."""
    max_predicted_fraction: float
    """Share of the evaluated images predicted as ``max_predicted_class`` (see
    ``fedmech_flwr.learning.training.DEGENERATE_FRACTION``)."""


def score(head: LinearHead, f: Tensor, y: Tensor, num_classes: int) -> Scores:
    """Accuracy, per-class recall and the most predicted class of ``head`` on features ``f``
    with labels ``y``."""
    pred = head.predict(f)
    return Scores(*recall(pred, y, num_classes), *largest_predicted_class(pred, num_classes))


@dataclass
class LinearTrainConfig:
    """AdamW on a linear layer over frozen features."""

    epochs: int = field(default=5, metadata={"ge": 1})
    batch_size: int = field(default=16, metadata={"ge": 1})
    lr: float = field(default=1e-3, metadata={"gt": 0.0})
    weight_decay: float = field(default=5e-4, metadata={"ge": 0.0})
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning rate over the epochs: cosine decay to 0 (per step), or constant."""


def ccvr_train_config() -> LinearTrainConfig:
    """CCVR's default head retraining on virtual features: 10 epochs, batch 64, lr 1e-2."""
    return LinearTrainConfig(epochs=10, batch_size=64, lr=1e-2)


def train_linear(
    f: Tensor, y: Tensor, start: LinearHead, cfg: LinearTrainConfig, generator: torch.Generator
) -> list[LinearHead]:
    """Train a linear layer from ``start`` on (f, y) with cross-entropy; return the head
    before training and after every epoch (``cfg.epochs + 1`` snapshots)."""
    layer = nn.Linear(f.shape[1], start.weight.shape[0]).to(f.device)
    start.install(layer)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(len(f) / cfg.batch_size)
    scheduler = (
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        if cfg.schedule == "cosine"
        else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    )
    snapshots = [LinearHead(start.weight.clone(), start.bias.clone())]
    with torch.enable_grad():
        for _ in range(cfg.epochs):
            order = torch.randperm(len(f), generator=generator).to(f.device)
            for i in range(0, len(f), cfg.batch_size):
                idx = order[i : i + cfg.batch_size]
                loss = nn.functional.cross_entropy(layer(f[idx]), y[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
            snapshots.append(LinearHead(layer.weight.detach().clone(), layer.bias.detach().clone()))
    return snapshots


def best_epoch(snapshots: list[LinearHead], f: Tensor, y: Tensor, num_classes: int) -> int:
    """Index of the snapshot with the highest accuracy on (f, y); the earliest on ties."""
    accuracies = [score(h, f, y, num_classes).accuracy for h in snapshots]
    return int(np.argmax(accuracies))


def balanced_split(y: Tensor, per_class: int, num_classes: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``per_class`` seeded random indices of every class, and all the other indices (both
    sorted). Fails clearly when a class has fewer samples."""
    labels = y.cpu()
    picks = []
    for c in range(num_classes):
        pool = torch.nonzero(labels == c).flatten()
        if len(pool) < per_class:
            raise ValueError(f"class {c} has {len(pool)} samples, {per_class} are needed")
        picks.append(pool[torch.randperm(len(pool), generator=generator)[:per_class]])
    picked = torch.cat(picks).sort().values
    rest = torch.ones(len(labels), dtype=torch.bool)
    rest[picked] = False
    return picked.to(y.device), torch.nonzero(rest).flatten().to(y.device)


def head_set_per_class(samples: int, available_per_class: int, num_classes: int, where: str) -> int:
    """Per-class size of a balanced head set of ``samples`` images when each class has
    ``available_per_class`` audit images to spare; bad sizes fail naming ``where``."""
    if samples < num_classes:
        raise ConfigError(
            f"{samples} samples must be at least the number of classes ({num_classes}): the head "
            "set is balanced, samples / classes per class",
            where,
        )
    per_class = samples // num_classes
    if per_class > available_per_class:
        raise ConfigError(
            f"a balanced head set of {samples} needs {per_class} per class, but the audit set has "
            f"{available_per_class} per class to spare for it; raise data.audit_per_class or lower the samples",
            where,
        )
    return per_class


@dataclass
class ClassStats:
    """Sufficient statistics of features per class, in float64.

    ``squares`` holds per-class sums of ``f * f`` (diagonal) or of ``f f^T`` (full).
    Statistics of disjoint data sets add up exactly (``ClassStats.sum``).
    """

    counts: np.ndarray
    """[C] samples per class."""
    sums: np.ndarray
    """[C, D] sums of features."""
    squares: np.ndarray
    """[C, D] or [C, D, D] sums of squares / outer products."""

    @property
    def covariance(self) -> Covariance:
        return "full" if self.squares.ndim == 3 else "diagonal"

    def means(self) -> np.ndarray:
        """[C, D] class means (0 for a class with no samples)."""
        return self.sums / np.maximum(self.counts, 1)[:, None]

    def variances(self) -> np.ndarray:
        """[C, D] (diagonal) or [C, D, D] (full) class covariances, population form."""
        n = np.maximum(self.counts, 1)
        mu = self.means()
        if self.covariance == "diagonal":
            return np.maximum(self.squares / n[:, None] - mu**2, 0.0)
        return self.squares / n[:, None, None] - np.einsum("cd,ce->cde", mu, mu)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"counts": self.counts, "sums": self.sums, "squares": self.squares}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> ClassStats:
        return cls(arrays["counts"], arrays["sums"], arrays["squares"])

    @classmethod
    def sum(cls, parts: list[ClassStats]) -> ClassStats:
        """The statistics of the union of the parts' data sets."""
        if not parts:
            raise ValueError("no class statistics to combine")
        return cls(*(np.sum([getattr(p, k) for p in parts], axis=0) for k in ("counts", "sums", "squares")))


def class_stats(f: Tensor, y: Tensor, num_classes: int, covariance: Covariance = "diagonal") -> ClassStats:
    """Per-class counts, sums and second moments of features ``f``."""
    f64 = f.detach().double().cpu()
    onehot = nn.functional.one_hot(y.cpu(), num_classes).double()  # [N, C]
    sums = onehot.T @ f64
    if covariance == "diagonal":
        squares = onehot.T @ (f64 * f64)
    else:
        squares = torch.einsum("nc,nd,ne->cde", onehot, f64, f64)
    return ClassStats(onehot.sum(0).numpy(), sums.numpy(), squares.numpy())


def ncm_head(stats: ClassStats, current: LinearHead) -> LinearHead:
    """The nearest-class-mean classifier as a linear head.

    argmin_c ||f - mu_c||^2 = argmax_c (f . mu_c - ||mu_c||^2 / 2), so row c is mu_c with
    bias -||mu_c||^2 / 2. A class no client holds keeps its current row.
    """
    mu = torch.from_numpy(stats.means()).to(current.weight)
    weight, bias = current.weight.clone(), current.bias.clone()
    seen = torch.from_numpy(stats.counts > 0).to(weight.device)
    weight[seen] = mu[seen]
    bias[seen] = -0.5 * (mu[seen] ** 2).sum(1)
    return LinearHead(weight, bias)


def tau_normalize(head: LinearHead, tau: float) -> LinearHead:
    """Kang et al. (2020): row c of the weight divided by ||w_c||^tau (bias unchanged).
    tau = 0 is the identity; tau = 1 gives every class a unit-norm weight."""
    norms = head.weight.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return LinearHead(head.weight / norms**tau, head.bias.clone())


def virtual_features(stats: ClassStats, per_class: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """CCVR (Luo et al. 2021): ``per_class`` samples from each held class's Gaussian
    N(mu_c, Sigma_c) (diagonal or full covariance, as the statistics were collected)."""
    mu, var = stats.means(), stats.variances()
    xs, ys = [], []
    for c in np.flatnonzero(stats.counts > 0):
        noise = torch.randn(per_class, mu.shape[1], generator=generator, dtype=torch.float64)
        if stats.covariance == "diagonal":
            sample = torch.from_numpy(mu[c]) + noise * torch.from_numpy(np.sqrt(var[c]))
        else:
            jitter = 1e-6 * np.eye(mu.shape[1])
            chol = torch.from_numpy(np.linalg.cholesky(var[c] + jitter))
            sample = torch.from_numpy(mu[c]) + noise @ chol.T
        xs.append(sample.float())
        ys.append(torch.full((per_class,), int(c)))
    if not xs:
        raise ValueError("no class has any samples in the statistics")
    return torch.cat(xs), torch.cat(ys)


def ccvr_head(
    stats: ClassStats, start: LinearHead, per_class: int, cfg: LinearTrainConfig, generator: torch.Generator
) -> LinearHead:
    """CCVR's head: ``start`` retrained on ``per_class`` virtual features of every held
    class (on ``start``'s device). The last epoch is kept: there is no data to select on."""
    f, y = virtual_features(stats, per_class, generator)
    device = start.weight.device
    return train_linear(f.to(device), y.to(device), start, cfg, generator)[-1]
