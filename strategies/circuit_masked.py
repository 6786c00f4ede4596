"""Circuit-masked averaging: each channel is averaged over the clients whose circuits use it.

This project's variant of a direction arXiv 2512.23043 v2 suggests for future methods
(aligning channels by circuit before averaging, via permutation symmetry): a channel that
implements part of one client's class circuits should not be diluted by clients that
never use it. Each output channel of a gated layer (its filter, bias and norm entries:
``FedMechModel.channel_arrays``) is averaged only over the clients whose local circuits,
for the classes each client holds, contain it, with FedAvg's client weights; a channel no
client's circuits contain is averaged over all clients; every other array as FedAvg.

The local circuits come from the ``circuits`` diagnostic's client side, which every client
runs after local training in the rounds the diagnostic is due and returns in its train
reply; so the diagnostic must run every round (checked before the run starts). That is
the cost: circuit discovery on every client every round (``gates.steps`` optimisation
steps per held class, several times the local training of a small CPU preset), plus the
diagnostic's server side.

The control is ``channels: random``: each client's channel set in each layer is replaced by
a random one of the same size (seeded from the run's seed, the round, the client's
partition-id and the layer), which separates the circuits' information from sparser
averaging as such. Per round the returned MetricRecord holds, per gated layer, the mean
number of clients each channel is averaged over (``clients/<layer>``) and the channels no
set contains (``unused/<layer>``). Client: any.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
from flwr.app import RecordDict

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, numpy_rng
from fedmech_flwr.api._builtin import REPORT_KEY, decode_results, unpack_masks
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    NamedArrays,
    StrategyContext,
    WeightedFedAvg,
    weighted_mean,
)

log = logging.getLogger(__name__)

CIRCUITS = "circuits"
"""The diagnostic whose client-side results carry the local circuits."""


@dataclass
class CircuitMaskedConfig(FedAvgConfig):
    channels: Literal["circuits", "random"] = "circuits"
    """Whose channel sets restrict the average: the clients' local circuits, or the
    control: random sets of the same size per client and layer."""


def circuit_channels(packed: bytes, layers: dict[str, int]) -> dict[str, np.ndarray]:
    """The channels a client's local circuits use, per gated layer: the union over its
    classes of the circuits diagnostic's packed ``masks``."""
    masks = list(unpack_masks(packed, layers).values())
    return {layer: np.any([m[layer] for m in masks], axis=0) if masks else np.zeros(size, bool)
            for layer, size in layers.items()}


def random_like(used: dict[str, np.ndarray], seed: int, server_round: int, partition_id: int) -> dict[str, np.ndarray]:
    """Random channel sets of the same sizes as ``used``, per layer."""
    out = {}
    for layer, mask in used.items():
        rng = numpy_rng(seed, f"circuit-masked-random/{layer}", partition_id, server_round)
        out[layer] = np.zeros(mask.size, bool)
        out[layer][rng.choice(mask.size, int(mask.sum()), replace=False)] = True
    return out


def channel_weights(used: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """[clients, channels] averaging weights of one layer: a client's FedAvg weight where
    its set ``used`` holds the channel, 0 elsewhere; a channel no set holds gets every
    client's FedAvg weight."""
    full = np.repeat(np.asarray(weights, np.float64)[:, None], len(used[0]), 1)
    masked = full * np.stack(used)
    unused = masked.sum(0) == 0
    masked[:, unused] = full[:, unused]
    return masked


class CircuitMaskedAvg(WeightedFedAvg):
    """FedAvg, except that each gated channel is averaged over the clients whose channel
    sets (local circuits, or the random control) hold it."""

    def __init__(self, params: CircuitMaskedConfig, ctx: StrategyContext) -> None:
        super().__init__(weighting=params.weighting, **OFFERED_NODES_ONLY)
        self.channels = params.channels
        self.seed = ctx.seed
        model = ctx.build_model(ctx.initial)
        self.layers = model.gated_layers()
        self.arrays = {layer: model.channel_arrays(layer) for layer in self.layers}

    def channel_sets(self, server_round: int, contents: list[RecordDict]) -> list[dict[str, np.ndarray]]:
        """Each reply's channel sets per gated layer."""
        sets = []
        for content in contents:
            report = content.config_records[REPORT_KEY]
            partition_id = int(report["partition-id"])
            results = decode_results(report)
            if CIRCUITS not in results:
                raise RuntimeError(f"round {server_round}: client {partition_id} sent no local circuits; "
                                   "circuit_masked_avg needs the circuits diagnostic every round")
            used = circuit_channels(results[CIRCUITS]["masks"], self.layers)
            random = self.channels != "circuits"
            sets.append(random_like(used, self.seed, server_round, partition_id) if random else used)
        return sets

    def average(
        self, server_round: int, contents: list[RecordDict], models: list[NamedArrays], weights: list[float]
    ) -> tuple[NamedArrays, dict[str, int | float]]:
        out = weighted_mean(models, weights)
        sets = self.channel_sets(server_round, contents)
        metrics: dict[str, int | float] = {}
        for layer in self.layers:
            per_channel = channel_weights([s[layer] for s in sets], weights)
            share = per_channel / per_channel.sum(0)
            for name in self.arrays[layer]:
                acc = sum(s.reshape(-1, *[1] * (m[name].ndim - 1)) * m[name].astype(np.float64)
                          for s, m in zip(share, models))
                out[name] = acc.astype(out[name].dtype)
            held = np.stack([s[layer] for s in sets])
            unused = ~held.any(0)
            metrics[f"clients/{layer}"] = float(held.sum(0)[~unused].mean()) if (~unused).any() else 0.0
            metrics[f"unused/{layer}"] = int(unused.sum())
        log.info("round %d: circuit_masked_avg (%s) channels per layer averaged over %s clients on average, "
                 "unused %s", server_round, self.channels,
                 {layer: round(metrics[f"clients/{layer}"], 2) for layer in self.layers},
                 {layer: metrics[f"unused/{layer}"] for layer in self.layers})
        return out, metrics


def check_circuit_masked_avg(params: CircuitMaskedConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """The local circuits of every round come from the circuits diagnostic, every round."""
    if not any(spec.name == CIRCUITS and spec.every == 1 for spec in cfg.diagnostics):
        found = [f"{spec.name} (every {spec.every})" for spec in cfg.diagnostics]
        raise ConfigError(
            "circuit_masked_avg averages each channel over the clients whose local circuits use it, so the circuits "
            f"diagnostic must run every round; diagnostics has {', '.join(found) or 'none'}: add "
            "{name: circuits, every: 1} to diagnostics", where)


STRATEGIES.register("circuit_masked_avg", CircuitMaskedConfig, check=check_circuit_masked_avg)(CircuitMaskedAvg)
