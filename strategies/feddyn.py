"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", ICLR,
arXiv:2111.04263), Algorithm 1.

The ``feddyn`` client k minimises L_k(theta) - <h_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
from theta^{t-1} and keeps h_k (see ``clients.feddyn``). The server keeps h (zeros at
first, one array per float parameter) and, with P_t the clients of round t and m the
number of all clients (``federation.num_clients``):

    h^t     = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

The average is uniform over P_t, as in the paper (there is no weighting option); buffers
take the plain mean. alpha (default 0.01; the paper's grid is {0.1, 0.01, 0.001}) is sent
to the clients in the train config. Its metric is ``feddyn-h-norm``, the L2 norm of h.

theta^t goes to the clients; the model evaluated and diagnosed is the plain mean, the model
the authors report (``avg_model`` in their code; with full participation theta^t is the
mean plus every past round's mean move, an extrapolation). The sent model's test accuracy
is recorded beside it (``sent-model-accuracy``, see
``fedmech_flwr.contracts.strategy.ReportsAnotherModel``).

Refused with magnitude pruning (h_k and h would absorb the pruner's zeroing of weights) and
with any local optimiser but plain SGD, the paper's and its authors' code's (their SGD has no
momentum and clips gradients at norm 10). Measured: the leaderboard's setting (SGD 0.05,
momentum 0.9, alpha 0.01, Fashion-MNIST, Dirichlet 0.05, seed 0) diverged within 15 rounds
where momentum 0 did not. A hypothesis, not tested: with momentum the local iterates
overshoot the minimiser that h_k assumes, and theta = mean - h / alpha accumulates the
overshoot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api._builtin import SENT_ACCURACY, all_of, dense_only, l2_norm, parameter_names, plain_sgd_only
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    NamedArrays,
    StrategyContext,
    WeightedFedAvg,
    weighted_mean,
)

ALPHA = "feddyn-alpha"
"""The train config key alpha is sent under (the ``feddyn`` client reads it)."""
H_NORM = "feddyn-h-norm"
"""The strategy's metric: the L2 norm of h."""


@dataclass
class FedDynConfig:
    alpha: float = field(default=0.01, metadata={"gt": 0.0})
    """alpha of the dynamic regulariser (the paper searches 0.1, 0.01 and 0.001)."""


class FedDyn(WeightedFedAvg):
    """FedAvg's uniform mean corrected by the server state h; ``h`` is its initial value
    (zeros of the float parameters). Reports the uncorrected mean (``reported``)."""

    reports = "the plain mean of the client models, as FedDyn's authors report it (theta = mean - h / alpha " \
              "goes to the clients)"

    def __init__(self, h: NamedArrays, alpha: float, num_clients: int, **kwargs) -> None:
        super().__init__(weighting="uniform", **kwargs)
        self.h = h
        self.alpha = alpha
        self.num_clients = num_clients
        self.mean: NamedArrays = {}
        """The last round's plain mean (empty before the first aggregation)."""

    def reported(self, sent: NamedArrays) -> NamedArrays:
        """The plain mean of the round whose corrected model is ``sent`` (``sent`` itself
        before the first round)."""
        return self.mean or sent

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        config[ALPHA] = self.alpha
        return super().configure_train(server_round, arrays, config, grid)

    def average(self, server_round: int, contents: list[RecordDict], models: list[NamedArrays],
                weights: list[float]) -> tuple[NamedArrays, dict[str, int | float]]:
        out = weighted_mean(models, weights)  # uniform weights: the buffers' plain mean
        self.mean = dict(out)
        for name, h in self.h.items():
            theta = self.sent[name].astype(np.float64)
            moved = sum(m[name].astype(np.float64) - theta for m in models)
            h_new = h - self.alpha * moved / self.num_clients
            out[name] = (theta + moved / len(models) - h_new / self.alpha).astype(self.sent[name].dtype)
            self.h[name] = h_new.astype(h.dtype)
        return out, {H_NORM: l2_norm(self.h)}

    def state_arrays(self) -> NamedArrays:
        return {**{f"h/{k}": v for k, v in self.h.items()}, **{f"mean/{k}": v for k, v in self.mean.items()}}

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        self.h = {k.removeprefix("h/"): v for k, v in arrays.items() if k.startswith("h/")}
        self.mean = {k.removeprefix("mean/"): v for k, v in arrays.items() if k.startswith("mean/")}


OUTPUTS = Outputs("FedDyn (strategy)", {
    H_NORM: Metric("server state h", (H_NORM,), "L2 norm", 4),
    SENT_ACCURACY: Metric("global accuracy of the corrected model theta sent to the clients", (SENT_ACCURACY,), "%",
                          better="higher"),
}, curves=(H_NORM, SENT_ACCURACY))


@STRATEGIES.register("feddyn", FedDynConfig, pairs_with=("feddyn",), outputs=OUTPUTS,
                     check=all_of(dense_only("feddyn", "h_k and h"),
                                  plain_sgd_only("feddyn", "as its paper and its authors' code do (at SGD momentum 0.9 "
                                                 "every client returned non-finite weights by round 9 of 15 on "
                                                 "Fashion-MNIST, Dirichlet 0.05)")))
def feddyn(params: FedDynConfig, ctx: StrategyContext) -> FedDyn:
    zeros = {name: np.zeros_like(ctx.initial[name]) for name in parameter_names(ctx)}
    return FedDyn(zeros, params.alpha, ctx.num_clients, **OFFERED_NODES_ONLY)
