"""Matched averaging: align each client's channels to a reference, then average as FedAvg.

Weight matching in the style of FedMA (Wang et al. 2020, arXiv:2002.06440) and Git
Re-Basin (Ainsworth et al. 2023, arXiv:2209.04836). Hidden channels can be permuted
without changing a network's function, so two clients may learn the same channels in a
different order, and averaging them position by position mixes unrelated channels. Before
averaging, each client's channels are matched, channel group by channel group (the model's
``permutation_groups()``: a conv's filters, its norm layer with its running statistics,
the next layer's input channels; ResNet10's channels tied by a skip connection share one
group), to a reference with an optimal assignment (``scipy.optimize.linear_sum_assignment``)
on a channel similarity, and the client is permuted accordingly. Models carry no pruning
masks (pruned weights are zeros), so the sparsity pattern moves with the weights.

- ``similarity: weights``: cosine similarity of the channels' weights (every array the
  group touches, the other axes permuted as currently matched); Git Re-Basin's coordinate
  descent over the groups until no permutation changes. Server data: none.
- ``similarity: activations``: correlation of the channels' activations on the server's
  audit set (``data.audit_per_class``), one assignment per group. Server data: the audit set.

The control is ``identity_below``: a group keeps the identity when matching raises its
mean channel similarity by less than this, so the channels that matching moves are the
ones credited. Per round the returned MetricRecord holds, per group, the channels moved
(summed over clients, ``moved/<group>``) and the mean similarity gain of the matching over
the identity (``gain/<group>``, also when the identity was kept). Client: any.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig
from fedmech_flwr.api._builtin import ChannelGroup, join_key
from fedmech_flwr.api.model import FedMechModel, build_model
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    NamedArrays,
    StrategyContext,
    WeightedFedAvg,
    from_record,
    weighted_mean,
)

log = logging.getLogger(__name__)

MAX_SWEEPS = 30
"""Coordinate-descent sweeps over the groups at most (weight matching stops earlier, as
soon as a sweep changes no permutation)."""
TIE = 1e-9
"""Added to the identity's similarities so that exact ties (e.g. all-zero pruned
channels) keep their place."""
BATCH = 256
"""Audit images per forward pass when recording activations."""

Perms = dict[str, np.ndarray]


@dataclass
class MatchedAvgConfig(FedAvgConfig):
    similarity: Literal["weights", "activations"] = "weights"
    """``weights``: cosine similarity of the channels' weights (no server data);
    ``activations``: correlation of their activations on the server's audit set."""
    reference: Literal["global", "largest_client"] = "global"
    """What clients are matched to: the model the round started from, or the round's
    client with the most examples (lowest partition-id on ties)."""
    layers: list[str] | None = None
    """Channel groups to match, by name (``conv1``; ResNet10: ``layer2.conv1``,
    ``stem+layer1.conv2`` ...); null: all. The others keep their order."""
    identity_below: float = field(default=0.0, metadata={"ge": 0.0})
    """Keep a group's identity when matching raises its mean channel similarity (in
    [-1, 1]) by less than this: 0 always matches, above 2 never does (FedAvg)."""


def axes_of(groups: list[ChannelGroup]) -> dict[str, list[tuple[int, int, ChannelGroup]]]:
    """Array name -> the (axis, block, group) entries that permute it."""
    axes: dict[str, list[tuple[int, int, ChannelGroup]]] = {}
    for group in groups:
        for name in group.rows:
            axes.setdefault(name, []).append((0, 1, group))
        for name, block in group.columns:
            axes.setdefault(name, []).append((1, block, group))
    return axes


def _permute_axis(array: np.ndarray, axis: int, block: int, perm: np.ndarray) -> np.ndarray:
    """``array`` with axis ``axis`` (in blocks of ``block`` entries) reordered by ``perm``:
    new channel i is old channel ``perm[i]``."""
    if axis == 0:
        return array[perm]
    shape = array.shape
    return array.reshape(shape[0], len(perm), block, *shape[2:])[:, perm].reshape(shape)


def _channels(array: np.ndarray, axis: int, block: int, size: int) -> np.ndarray:
    """One row per channel of ``axis``: every entry of ``array`` that belongs to it."""
    if axis == 0:
        return array.reshape(size, -1)
    return np.moveaxis(array.reshape(array.shape[0], size, block, *array.shape[2:]), 1, 0).reshape(size, -1)


def permute(arrays: NamedArrays, groups: list[ChannelGroup], perms: Perms) -> NamedArrays:
    """A copy of ``arrays`` with every group's channels reordered by its permutation (the
    same function, for a model whose ``permutation_groups()`` these are)."""
    out = dict(arrays)
    for name, entries in axes_of(groups).items():
        for axis, block, group in entries:
            out[name] = _permute_axis(out[name], axis, block, perms[group.name])
    return out


def assign(similarity: np.ndarray, identity_below: float) -> tuple[np.ndarray, float]:
    """The permutation maximising the summed similarity of reference channel i and
    client channel ``perm[i]``, and its mean similarity gain over the identity; the
    identity when that gain is below ``identity_below``."""
    from scipy.optimize import linear_sum_assignment  # here: every ClientApp imports the strategies

    n = len(similarity)
    _, perm = linear_sum_assignment(similarity + TIE * np.eye(n), maximize=True)
    gain = float(similarity[np.arange(n), perm].mean() - np.trace(similarity) / n)
    return (np.arange(n) if gain < identity_below else perm), gain


def _cosine(dot: np.ndarray, ref_sq: np.ndarray, client_sq: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.outer(ref_sq, client_sq))
    return np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0)


def weight_matching(
    reference: NamedArrays, client: NamedArrays, groups: list[ChannelGroup], identity_below: float
) -> tuple[Perms, dict[str, float]]:
    """Git Re-Basin's weight matching: each group in turn gets the assignment on the
    cosine similarity of its channels (all arrays it touches, their other axes permuted
    by the other groups' current permutations), until a sweep changes nothing."""
    axes = axes_of(groups)
    reference, client = ({k: arrays[k].astype(np.float64) for k in axes} for arrays in (reference, client))
    perms = {g.name: np.arange(g.size) for g in groups}
    gains = {g.name: 0.0 for g in groups}
    for _ in range(MAX_SWEEPS):
        changed = False
        for group in groups:
            dot = np.zeros((group.size, group.size))
            ref_sq, client_sq = np.zeros(group.size), np.zeros(group.size)
            for name in (*group.rows, *(n for n, _ in group.columns)):
                array = client[name]
                for axis, block, other in axes[name]:
                    if other is group:
                        own = (axis, block)
                    else:
                        array = _permute_axis(array, axis, block, perms[other.name])
                r = _channels(reference[name], *own, group.size)
                c = _channels(array, *own, group.size)
                dot += r @ c.T
                ref_sq += (r * r).sum(1)
                client_sq += (c * c).sum(1)
            perm, gains[group.name] = assign(_cosine(dot, ref_sq, client_sq), identity_below)
            changed |= not np.array_equal(perm, perms[group.name])
            perms[group.name] = perm
        if not changed:
            break
    return perms, gains


@torch.no_grad()
def channel_activations(model: FedMechModel, x: torch.Tensor, groups: list[ChannelGroup]) -> dict[str, np.ndarray]:
    """Per group, one row per channel: its activations at every output module of the
    group, over the images ``x`` and all positions, standardised (zero mean, unit norm)."""
    modules = sorted({m for g in groups for m in g.activations})
    seen: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
    hooks = [model.get_submodule(m).register_forward_hook(lambda _, __, out, m=m: seen[m].append(out.transpose(0, 1)))
             for m in modules]
    try:
        for start in range(0, len(x), BATCH):
            model(x[start : start + BATCH])
    finally:
        for hook in hooks:
            hook.remove()
    rows = {}
    for group in groups:
        acts = torch.cat([torch.cat(seen[m], 1).reshape(group.size, -1) for m in group.activations], 1).double()
        acts = acts - acts.mean(1, keepdim=True)
        norms = acts.norm(dim=1, keepdim=True)
        rows[group.name] = torch.where(norms > 0, acts / norms.clamp_min(1e-300), 0.0).cpu().numpy()
    return rows


def activation_matching(
    reference: dict[str, np.ndarray], client: dict[str, np.ndarray], groups: list[ChannelGroup], identity_below: float
) -> tuple[Perms, dict[str, float]]:
    """Per group the assignment on the correlation of the channels' activations
    (``channel_activations`` of both models; a model's activations do not depend on how
    its channels are ordered, so the groups are matched independently)."""
    perms, gains = {}, {}
    for group in groups:
        perms[group.name], gains[group.name] = assign(reference[group.name] @ client[group.name].T, identity_below)
    return perms, gains


class MatchedAvg(WeightedFedAvg):
    """FedAvg of the clients' models after permuting each one's channels onto the reference."""

    def __init__(self, params: MatchedAvgConfig, ctx: StrategyContext) -> None:
        super().__init__(weighting=params.weighting, **OFFERED_NODES_ONLY)
        self.params = params
        self.ctx = ctx
        groups = ctx.build_model(ctx.initial).permutation_groups()
        self.groups = [g for g in groups if params.layers is None or g.name in params.layers]
        self._start = ctx.initial

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self._start = from_record(arrays)  # the default reference: the model this round starts from
        return super().configure_train(server_round, arrays, config, grid)

    def match(self, reference: NamedArrays, models: list[NamedArrays]) -> list[tuple[Perms, dict[str, float]]]:
        """Each model's permutations onto ``reference`` and their similarity gains."""
        p = self.params
        if p.similarity == "weights":
            return [weight_matching(reference, m, self.groups, p.identity_below) for m in models]
        x = self.ctx.audit[0]  # check_matched_avg made sure there is an audit set
        ref = channel_activations(self.ctx.build_model(reference), x, self.groups)
        return [activation_matching(ref, channel_activations(self.ctx.build_model(m), x, self.groups), self.groups,
                                    p.identity_below) for m in models]

    def average(
        self, server_round: int, contents: list[RecordDict], models: list[NamedArrays], weights: list[float]
    ) -> tuple[NamedArrays, dict[str, int | float]]:
        if self.params.reference == "global":
            reference = self._start
        else:
            examples = [int(next(iter(c.metric_records.values()))["num-examples"]) for c in contents]
            reference = models[int(np.argmax(examples))]
        matched = self.match(reference, models)
        aligned = [permute(m, self.groups, perms) for m, (perms, _) in zip(models, matched)]
        metrics: dict[str, int | float] = {}
        for group in self.groups:
            metrics[f"moved/{group.name}"] = sum(int((perms[group.name] != np.arange(group.size)).sum())
                                                 for perms, _ in matched)
            metrics[f"gain/{group.name}"] = float(np.mean([gains[group.name] for _, gains in matched]))
        moved = sum(v for k, v in metrics.items() if k.startswith("moved/"))
        log.info("round %d: matched_avg moved %d channels over %d clients (%s)", server_round, moved, len(models),
                 ", ".join(f"{g.name} {metrics[f'moved/{g.name}']}, gain {metrics[f'gain/{g.name}']:.3f}"
                           for g in self.groups))
        return weighted_mean(aligned, weights), metrics


def check_matched_avg(params: MatchedAvgConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """The model must give its channel groups (a wrapped module does not), and layers name
    them; activations need the audit set."""
    if params.similarity == "activations":
        data.require_audit("matched_avg (similarity: activations) compares channel activations on", where, 50)
    with torch.random.fork_rng(devices=[]):  # a check leaves the caller's random state alone
        model = build_model(cfg.model.name, cfg.model.params, in_channels=data.input_shape[0],
                            num_classes=data.num_classes, image_size=data.input_shape[1])
    try:
        groups = model.permutation_groups()
    except NotImplementedError as err:
        raise ConfigError(f"matched_avg permutes channel groups, which model '{cfg.model.name}' does not "
                          f"give: {err}", where) from err
    if params.layers is not None:
        names = [g.name for g in groups]
        unknown = [name for name in params.layers if name not in names]
        if unknown or not params.layers:
            raise ConfigError(f"layers must name channel groups of model '{cfg.model.name}' ({', '.join(names)}), "
                              f"got {params.layers}", join_key(where, "layers"))


STRATEGIES.register("matched_avg", MatchedAvgConfig, check=check_matched_avg)(MatchedAvg)
