"""Per-layer unstructured magnitude pruning during local training (FL with ~99.9% sparse
models).

No masks are stored: after every optimizer step the smallest-magnitude weights of each
layer are zeroed in place, so the state_dict keys stay those of the dense model and FedAvg
averages plain weights (torch.nn.utils.prune would add weight_orig/weight_mask, which
FedAvg would average into nonsense).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from fedmech_flwr.models.base import FedMechModel

logger = logging.getLogger(__name__)


@dataclass
class PruningConfig:
    mode: Literal["magnitude", "dense"] = "magnitude"
    """"magnitude" prunes during local training; "dense" leaves the model dense."""
    target_sparsity: float = field(default=0.999, metadata={"ge": 0.0, "lt": 1.0})
    """Fraction of exactly-zero weights each pruned layer reaches (per layer)."""
    ramp_fraction: float = field(default=0.5, metadata={"ge": 0.0, "le": 1.0})
    """Fraction of a client's local steps over which sparsity ramps from its start value to
    the target; 0 prunes to the target at the first step."""
    schedule: Literal["cubic", "linear"] = "cubic"
    """Ramp shape; "cubic" is Zhu & Gupta (2017): prunes fast early, slowly near the target."""
    include_head: bool = False
    """Also prune the classifier head (small and sensitive, so left dense by default)."""
    min_weights_per_filter: int = field(default=0, metadata={"ge": 0})
    """Always keep the k largest-magnitude weights of every output filter (row) so no filter
    dies entirely. They count towards the layer's kept weights; only when
    out_channels * k exceeds that budget does the layer end up denser than the target."""
    server_reprune: bool = False
    """Re-prune the global model to the target per layer after FedAvg. By default the server
    averages the effective (already zeroed) client weights, so the global model is the union
    of the client supports and denser than each client; this restores the nominal sparsity."""


def _pruned_parameters(model: FedMechModel, include_head: bool) -> dict[str, nn.Parameter]:
    head = set() if include_head else model.head_parameter_names()
    return {n: p for n, p in model.prunable_parameters().items() if n not in head}


@torch.no_grad()
def _prune_(weight: Tensor, sparsity: float, min_per_filter: int) -> None:
    """Zero the ``round(sparsity * numel)`` smallest-magnitude entries of ``weight`` in
    place, sparing the ``min_per_filter`` largest of each output filter."""
    n = weight.numel()
    drop = round(sparsity * n)
    if drop == 0:
        return
    scores = weight.detach().abs().reshape(weight.shape[0], -1)
    if min_per_filter > 0:
        k = min(min_per_filter, scores.shape[1])
        scores.scatter_(1, scores.topk(k, dim=1).indices, float("inf"))
        drop = min(drop, n - k * scores.shape[0])
    dropped = scores.flatten().topk(drop, largest=False, sorted=False).indices
    mask = torch.zeros(n, dtype=torch.bool, device=weight.device)
    weight.masked_fill_(mask.scatter_(0, dropped, True).view(weight.shape), 0.0)


class MagnitudePruner:
    """Prunes a model's layers to a scheduled sparsity after each local optimizer step.

    The schedule ramps from ``start_sparsity`` (e.g. that of the received global model) to
    the target over ``ramp_fraction * total_steps`` steps and stays at the target after.
    """

    def __init__(
        self,
        model: FedMechModel,
        cfg: PruningConfig,
        total_steps: int,
        start_sparsity: float = 0.0,
    ) -> None:
        if not 0.0 <= start_sparsity < 1.0:
            raise ValueError(f"start_sparsity must be in [0, 1), got {start_sparsity}")
        self.cfg = cfg
        self.start_sparsity = start_sparsity
        self.ramp_steps = cfg.ramp_fraction * total_steps
        self.weights = _pruned_parameters(model, cfg.include_head)
        logger.debug(
            "%s pruning of %d layers: %.4f -> %.4f over %.1f of %d steps",
            cfg.mode, len(self.weights), start_sparsity, cfg.target_sparsity,
            self.ramp_steps, total_steps,
        )

    def sparsity_at(self, step: int) -> float:
        """Scheduled sparsity after ``step`` completed optimizer steps."""
        target = self.cfg.target_sparsity
        if step >= self.ramp_steps:
            return target
        progress = step / self.ramp_steps
        if self.cfg.schedule == "cubic":
            return target + (self.start_sparsity - target) * (1.0 - progress) ** 3
        return self.start_sparsity + (target - self.start_sparsity) * progress

    def step(self, step_index: int) -> None:
        """Call after optimizer step ``step_index`` (0-based): prunes every layer to
        ``sparsity_at(step_index + 1)``, so the last ramp step lands on the target."""
        if self.cfg.mode == "dense":
            return
        sparsity = self.sparsity_at(step_index + 1)
        for weight in self.weights.values():
            _prune_(weight, sparsity, self.cfg.min_weights_per_filter)


def prune_to(model: FedMechModel, sparsity: float, cfg: PruningConfig) -> None:
    """One-shot magnitude prune of every layer to ``sparsity`` (server re-pruning).

    Honours ``cfg.include_head`` and ``cfg.min_weights_per_filter``; ``cfg.mode`` is the
    caller's to check.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    for weight in _pruned_parameters(model, cfg.include_head).values():
        _prune_(weight, sparsity, cfg.min_weights_per_filter)


def layer_sparsity(model: FedMechModel) -> dict[str, float]:
    """Actual fraction of exactly-zero weights per prunable layer, head included."""
    return {
        name: (weight == 0).sum().item() / weight.numel()
        for name, weight in model.prunable_parameters().items()
    }


def overall_sparsity(model: FedMechModel, include_head: bool) -> float:
    """Zero weights / all weights over the prunable layers (the head only if asked)."""
    weights = _pruned_parameters(model, include_head).values()
    zeros = sum((w == 0).sum().item() for w in weights)
    return zeros / sum(w.numel() for w in weights)
