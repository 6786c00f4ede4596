"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS, arXiv:2007.07481): normalized averaging.

Clients that take more local steps move further, so FedAvg's mean leans towards their
objectives. FedNova divides each client's update by the L1 norm of its aggregation vector
a_i (``fednova-a-norm``, reported by the ``fednova`` client: tau_i for plain SGD) and
rescales the mean by the effective number of steps (the paper's normalized update, with
x - y_i = eta G_i a_i):

    d_i     = (x - y_i) / ||a_i||_1
    tau_eff = sum_i p_i ||a_i||_1
    x      <- x - tau_eff * sum_i p_i d_i

for the float parameters; buffers take the weighted mean. p_i follows ``weighting``:
``examples`` (n_i / sum n, the paper's) or ``uniform``. With equal a_i it is FedAvg. The
a_i assume local SGD, so the strategy refuses any other ``train.optimizer``. It also
refuses magnitude pruning: x - y_i would count the weights the pruner zeroed as gradient
steps, and with unequal a_i a weight every client pruned moves off 0 (x = [1, 2], clients
at [0, 1] and [0, 3] with 10 and 30 examples and ||a_i|| = 1 and 4 give w_0 = -0.42).
Its metric is ``fednova-tau-eff``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import RecordDict

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api._builtin import all_of, dense_only, parameter_names, sgd_only
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    NamedArrays,
    StrategyContext,
    WeightedFedAvg,
    weighted_mean,
)

A_NORM = "fednova-a-norm"
"""The metric the ``fednova`` client reports ||a_i||_1 under."""


class FedNova(WeightedFedAvg):
    """FedAvg whose float parameters take the normalized average of the clients' updates."""

    def __init__(self, float_names: list[str], weighting: str = "examples", **kwargs) -> None:
        super().__init__(weighting=weighting, **kwargs)
        self.float_names = float_names

    def average(self, server_round: int, contents: list[RecordDict], models: list[NamedArrays],
                weights: list[float]) -> tuple[NamedArrays, dict[str, int | float]]:
        metrics = [next(iter(c.metric_records.values())) for c in contents]
        if any(A_NORM not in m for m in metrics):
            raise RuntimeError(f"a client reported no '{A_NORM}': fednova needs the fednova client")
        norms = [float(m[A_NORM]) for m in metrics]
        total = float(sum(weights))
        p = [w / total for w in weights]
        tau_eff = sum(p_i * a for p_i, a in zip(p, norms))
        out = weighted_mean(models, weights)
        for name in self.float_names:
            x = self.sent[name].astype(np.float64)
            d = sum(p_i * (x - m[name]) / a for p_i, m, a in zip(p, models, norms))
            out[name] = (x - tau_eff * d).astype(self.sent[name].dtype)
        return out, {"fednova-tau-eff": tau_eff}


OUTPUTS = Outputs("FedNova (strategy)", {
    "fednova_tau_eff": Metric("effective local steps tau_eff", ("fednova_tau_eff",), "steps", 1),
}, curves=("fednova_tau_eff",))


@STRATEGIES.register("fednova", FedAvgConfig, pairs_with=("fednova",), outputs=OUTPUTS,
                     check=all_of(sgd_only("fednova", "normalises by the aggregation vectors of local SGD"),
                                  dense_only("fednova", "x by tau_eff sum_i p_i (x - y_i) / ||a_i||_1")))
def fednova(params: FedAvgConfig, ctx: StrategyContext) -> FedNova:
    return FedNova(parameter_names(ctx), weighting=params.weighting, **OFFERED_NODES_ONLY)
