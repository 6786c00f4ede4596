"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML, arXiv:1910.06378), option II control variates.

The server keeps the model x and the control variate c (zeros at first, one array per
float parameter; buffers have none). In a round with sampled clients S of N
(``federation.num_clients``), Algorithm 1:

- every i in S gets x and c (the ArrayRecord ``scaffold-c``); the ``scaffold`` client takes
  K steps of y <- y - eta_l (g_i(y) - c_i + c) from y = x and returns y_i and
  delta_c_i = c_i+ - c_i with c_i+ = c_i - c + (x - y_i) / (K eta_l) (option II; K
  becomes the momentum-weighted step count with ``train.momentum`` > 0, see
  ``clients.scaffold``);
- the server (lines 16-17):

      x <- x + eta_g * sum_{i in S} w_i (y_i - x)
      c <- c + (|S| / N) * (1 / |S|) sum_{i in S} delta_c_i

w_i follows ``weighting`` as in fedavg: ``examples`` (n_i / sum_S n_j, the default, so that
eta_g = 1 gives fedavg's aggregate) or ``uniform`` (1 / |S|, the paper's). Buffers take the
plain weighted mean. c is always the uniform update of the paper: it stays the mean of all
N clients' c_i. Option II assumes plain local SGD, so the strategy refuses any other
``train.optimizer``. It also refuses magnitude pruning: x - y_i would count the weights the
pruner zeroed as gradient steps, and the paper defines no control variate on a changing
support. Its metric is ``scaffold-control-norm``, the L2 norm of c.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedmech_flwr.arrays import NamedArrays, l2_norm, to_record, weighted_mean
from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.data import DataInfo
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.outputs import Metric, Outputs
from fedmech_flwr.strategy import OFFERED_NODES_ONLY, STRATEGIES, StrategyContext, uploaded
from strategies.fedavg import FedAvgConfig, WeightedFedAvg

CONTROL = "scaffold-c"
"""The train message's ArrayRecord holding c (the ``scaffold`` client reads it)."""
DELTA_CONTROL = "scaffold-delta-c"
"""What the ``scaffold`` client uploads: c_i+ - c_i, by parameter name."""


@dataclass
class ScaffoldConfig(FedAvgConfig):
    server_lr: float = field(default=1.0, metadata={"gt": 0.0})
    """eta_g, the server's step along the clients' mean update; 1 (the paper's) takes the mean."""


Check = Callable[[object, ExperimentConfig, DataInfo, str], None]
"""A registration's ``check(params, cfg, data, where)``."""


def sgd_only(method: str, why: str) -> Check:
    """A ``check`` refusing any local optimizer but SGD: ``method`` ``why`` (the reason)."""
    def check(params: object, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
        if cfg.train.optimizer != "sgd":
            raise ConfigError(f"{method} {why}, but train.optimizer is {cfg.train.optimizer}; set train.optimizer=sgd",
                              where)
    return check


def dense_only(method: str, state: str) -> Check:
    """A ``check`` refusing magnitude pruning: ``method`` updates its ``state`` from the
    clients' moves, which would count the weights the pruner zeroed as training steps."""
    def check(params: object, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
        if cfg.pruning.mode != "dense":
            raise ConfigError(f"{method} updates {state} from the clients' moves (trained minus sent weights), which "
                              f"with pruning.mode={cfg.pruning.mode} count the weights the pruner set to 0 as steps of "
                              "local training (the paper defines no such state on a pruned support); "
                              "set pruning.mode=dense", where)
    return check


def all_of(*checks: Check) -> Check:
    """One ``check`` that runs ``checks`` in turn."""
    def check(params: object, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
        for one in checks:
            one(params, cfg, data, where)
    return check


def parameter_names(ctx: StrategyContext) -> list[str]:
    """The model's float parameters (``named_parameters``), which carry the methods' states;
    buffers do not."""
    return [name for name, _ in ctx.build_model(ctx.initial).named_parameters()]


class Scaffold(WeightedFedAvg):
    """FedAvg that sends c with the model, steps the model by eta_g and updates c from the
    uploaded delta_c_i. ``control`` is the initial c (zeros of the float parameters)."""

    def __init__(self, control: NamedArrays, num_clients: int, server_lr: float = 1.0, weighting: str = "examples",
                 **kwargs) -> None:
        super().__init__(weighting=weighting, **kwargs)
        self.control = control
        self.num_clients = num_clients
        self.server_lr = server_lr

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        control = to_record(self.control)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for msg in messages:  # Flower's messages share one content: each gets its own
            msg.content = RecordDict({**msg.content, CONTROL: control})
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = [r for r in replies if not r.has_error()]
        deltas = [uploaded(r, DELTA_CONTROL) for r in replies]
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, None
        self.control = {name: (c + sum(d[name].astype(np.float64) for d in deltas) / self.num_clients).astype(c.dtype)
                        for name, c in self.control.items()}
        metrics["scaffold-control-norm"] = l2_norm(self.control)
        return arrays, metrics

    def average(self, server_round: int, contents: list[RecordDict], models: list[NamedArrays],
                weights: list[float]) -> tuple[NamedArrays, dict[str, int | float]]:
        """x + eta_g * sum_i w_i (y_i - x) for the float parameters; buffers: the weighted mean."""
        out = weighted_mean(models, weights)
        total = float(sum(weights))
        for name in self.control:
            x = self.sent[name].astype(np.float64)
            step = sum((w / total) * (m[name].astype(np.float64) - x) for m, w in zip(models, weights))
            out[name] = (x + self.server_lr * step).astype(self.sent[name].dtype)
        return out, {}

    def state_arrays(self) -> NamedArrays:
        return dict(self.control)

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        self.control = dict(arrays)


OUTPUTS = Outputs("SCAFFOLD (strategy)", {
    "scaffold_control_norm": Metric("server control variate c", ("scaffold_control_norm",), "L2 norm", 4),
}, curves=("scaffold_control_norm",))


@STRATEGIES.register("scaffold", ScaffoldConfig, pairs_with=("scaffold",), outputs=OUTPUTS,
                     check=all_of(sgd_only("scaffold", "estimates the control variates from local SGD steps (option II)"),
                                  dense_only("scaffold", "the control variates c_i and c")))
def scaffold(params: ScaffoldConfig, ctx: StrategyContext) -> Scaffold:
    zeros = {name: np.zeros_like(ctx.initial[name]) for name in parameter_names(ctx)}
    return Scaffold(zeros, ctx.num_clients, params.server_lr, weighting=params.weighting, **OFFERED_NODES_ONLY)
