"""The training engine: local epochs over in-memory tensors, evaluation, seeding, devices.

Data stays as tensors (decoded and normalised once); batches are index slices, so no
per-sample transforms run in the loop.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from fedmech_flwr.foundation.seeds import seed_globals
from fedmech_flwr.learning.pruning import MagnitudePruner

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Local training, identical for every client plug-in."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """The local optimiser, made fresh every round (no optimiser state crosses rounds)."""
    lr: float = field(default=1e-3, metadata={"gt": 0.0})
    """Local learning rate."""
    momentum: float = field(default=0.9, metadata={"ge": 0.0, "lt": 1.0})
    """SGD momentum (ignored by Adam)."""
    weight_decay: float = field(default=0.0, metadata={"ge": 0.0})
    """L2 weight decay of the local optimiser."""
    epochs: int = field(default=1, metadata={"ge": 1, "le": 10_000})
    """Local epochs per round."""
    batch_size: int = field(default=64, metadata={"ge": 1, "le": 1_000_000})
    """Local mini-batch size."""
    max_samples_per_round: int | None = field(default=None, metadata={"ge": 1, "le": 100_000_000})
    """Train on a seeded random subset of this many local samples per round; null = all."""


Objective = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``objective(images, labels) -> (loss, logits)`` of one batch: what local training minimises."""


def cross_entropy_objective(model: nn.Module) -> Objective:
    """The plain objective: the cross-entropy of ``model``'s logits."""
    def objective(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x)
        return nn.functional.cross_entropy(logits, y), logits
    return objective


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when torch sees it, else the CPU (also in a Ray actor given a
    share of a GPU that torch cannot see: Ray's GPU resources are declarations);
    ``cuda`` without a GPU is an error (``check_experiment`` refuses it before a run)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device is 'cuda' but torch sees no CUDA device in this process; set device: auto or cpu")
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def channels_last_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its conv weights in channels-last layout, for passes that do
    not train it (diagnostics): on CPUs oneDNN runs these convolutions about 1.2x (forward
    and backward) to 1.8x (forward only) faster. The copy leaves the model untouched."""
    return copy.deepcopy(model).to(memory_format=torch.channels_last)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """Images [N, C, H, W] in channels-last layout (other tensors as they are)."""
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch with ``seed`` (from ``fedmech_flwr.foundation.seeds.seed_for``).

    Returns a CPU generator for batch order, so data order does not depend on how many
    random numbers other code drew before.
    """
    seed_globals(seed)
    return torch.Generator().manual_seed(seed)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def recall(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[float, list[float | None]]:
    """Accuracy and per-class recall of predictions ``pred`` for labels ``y`` (None for a
    class absent from ``y``), computed in float32 as every recorded metric is."""
    hits = (pred == y).float()
    counts = torch.bincount(y, minlength=num_classes)
    correct = torch.bincount(y, weights=hits, minlength=num_classes)
    per_class = [(correct[c] / counts[c]).item() if counts[c] > 0 else None for c in range(num_classes)]
    return (hits.mean().item() if len(y) else 0.0), per_class


def largest_predicted_class(pred: torch.Tensor, num_classes: int) -> tuple[int, float]:
    """The class predicted most often in ``pred`` and the share of predictions that are it
    (0.0 for no predictions); above ``DEGENERATE_FRACTION`` the predictor is degenerate."""
    counts = torch.bincount(pred.cpu(), minlength=num_classes)
    top = int(counts.argmax())
    return top, (counts[top].item() / len(pred) if len(pred) else 0.0)


@dataclass
class TrainStats:
    loss: float
    accuracy: float
    per_class_accuracy: list[float | None]
    """Running recall per class over the last local epoch (None: no samples of the class)."""
    num_examples: int
    steps: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.num_examples / self.seconds if self.seconds > 0 else 0.0


def local_steps(num_samples: int, cfg: TrainConfig) -> int:
    """Optimizer steps one client takes in one round (the pruning schedule's length)."""
    return cfg.epochs * -(-num_samples // cfg.batch_size)


def a_norm(steps: int, momentum: float) -> float:
    """||a_i||_1 of ``steps`` local SGD steps with heavy-ball ``momentum`` rho (FedNova's
    normaliser, Wang et al. 2020, arXiv:2007.07481): how many gradients the steps add up
    to, ``steps`` without momentum."""
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    generator: torch.Generator,
    objective: Objective,
    pruner: MagnitudePruner | None = None,
) -> TrainStats:
    """Train ``model`` for ``cfg.epochs`` epochs on (x, y) to minimise ``objective``,
    pruning after every step."""
    model.train()
    optimizer = make_optimizer(model.parameters(), cfg)
    n = len(x)
    num_classes = model.get_classifier().out_features
    total_loss, correct, seen, step = 0.0, 0, 0, 0
    last_pred = torch.empty_like(y)  # every epoch overwrites each sample's prediction
    start = time.perf_counter()
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator).to(x.device)
        for i in range(0, n, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            xb, yb = x[idx], y[idx]
            loss, logits = objective(xb, yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if pruner is not None:
                pruner.step(step)
            step += 1
            pred = logits.detach().argmax(1)
            last_pred[idx] = pred
            total_loss += loss.item() * len(yb)
            correct += int((pred == yb).sum().item())
            seen += len(yb)
    seconds = time.perf_counter() - start
    _, per_class = recall(last_pred, y, num_classes)
    return TrainStats(total_loss / max(seen, 1), correct / max(seen, 1), per_class, seen, step, seconds)


@dataclass
class EvalResult:
    loss: float
    accuracy: float
    per_class_accuracy: list[float | None]
    """Recall of each class; None for a class with no samples in the evaluated set."""
    num_examples: int
    max_predicted_class: int
    max_predicted_fraction: float
    """Share of the images predicted as ``max_predicted_class``; above
    ``DEGENERATE_FRACTION`` the model is a degenerate (one-class) predictor."""


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int = 1000) -> EvalResult:
    """Cross-entropy loss, accuracy and per-class accuracy (recall) of ``model`` on (x, y)."""
    model.eval()
    loss_sum, preds = 0.0, []
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size])
        loss_sum += nn.functional.cross_entropy(logits, y[i : i + batch_size], reduction="sum").item()
        preds.append(logits.argmax(1))
    pred = torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=x.device)
    accuracy, per_class = recall(pred, y, num_classes)
    return EvalResult(loss_sum / max(len(y), 1), accuracy, per_class, len(y), *largest_predicted_class(pred, num_classes))
