"""Flower's server optimisers, wrapped as they are: FedAdam, FedYogi, FedAdagrad, FedAvgM.

Adaptive federated optimisation (Reddi et al. 2021, ICLR, arXiv:2003.00295, Algorithm 2)
treats the mean client update as a pseudo-gradient for a server optimiser. With x_t the
model sent in round t and Delta_t = (mean of the clients' models) - x_t:

    m_t = beta_1 m_{t-1} + (1 - beta_1) Delta_t
    v_t = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2                      FedAdam
    v_t = v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2)   FedYogi
    v_t = v_{t-1} + Delta_t^2                                          FedAdagrad
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

as Flower 1.42 implements it, which differs from Algorithm 2 in three places: m and v
start at 0 (the paper: v_{-1} >= tau^2); FedAdagrad has beta_1 = 0 (m_t = Delta_t);
FedAdam's eta is bias-corrected, eta_t = eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))
with t the server round (Kingma & Ba's correction, with the exponent one above theirs).

FedAvgM (Hsu et al. 2019, arXiv:1909.06335) is server SGD with momentum on the
pseudo-gradient g_t = x_t - mean, in PyTorch's convention (v_1 = g_1):

    v_t = beta v_{t-1} + g_t,    x_{t+1} = x_t - eta v_t

(``server_momentum`` beta, ``server_learning_rate`` eta; Flower's defaults, 0 and 1, make it
FedAvg), where x_t is FedAvgM's own last aggregate, which is the model sent unless
``pruning.server_reprune`` re-prunes it before it is sent.

The mean is fedmech's (``WeightedFedAvg``: float64, client weights by examples, Flower's
default, or uniform, as Algorithm 2 writes it), reached through Flower's own ``super()``
calls.
What the wrapper adds, and nothing more:

- the server optimiser's state (m_t and v_t; FedAvgM's momentum vector and last
  aggregate) saved and restored for a resume (``Resumable``);
- the returned model in the model's names, order and dtypes: Flower returns float64
  (FedAdam's bias-corrected eta is a NumPy float64, which promotes float32 weights) and
  turns integer buffers into floats; each array is cast back, integers rounded;
- ``fedopt-update-norm``, the L2 norm of the server's step x_{t+1} - x_t (floating-point
  arrays), in the round's strategy record;
- coordinates the server never steps (``ServerOptimiser.average``): buffers (BatchNorm's
  running statistics and counter) take the mean, and, when the clients prune
  (``pruning.mode: magnitude``), a parameter's coordinate whose mean is exactly 0 (every
  client pruned it) stays exactly 0, as under FedAvg. Flower steps every coordinate: a
  weight every client returned at 0 ended near 0.27 after 3 rounds. On a held coordinate
  x_t is set to the mean and the optimiser's state (m_t and v_t; the momentum vector) to 0
  before Flower's step, which then leaves the mean there and its state at 0: the states
  never accumulate what pruning or a buffer's average moved.

Flower's ``eta_l`` (the clients' learning rate in the paper) is not a parameter here: Flower
only logs it (at its default), and the clients train with ``train.lr``, so ``strategy.eta_l``
is refused as an unknown key rather than accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api._builtin import cast, l2_norm, parameter_names
from fedmech_flwr.api.strategy import (
    OFFERED_NODES_ONLY,
    STRATEGIES,
    FedAvgConfig,
    NamedArrays,
    StrategyContext,
    WeightedFedAvg,
    from_record,
    to_record,
)

UPDATE_NORM = "fedopt-update-norm"

OUTPUTS = Outputs("Server optimiser (strategy)", {
    UPDATE_NORM: Metric("server step ||x_{t+1} - x_t||", (UPDATE_NORM,), "L2", 3),
}, curves=(UPDATE_NORM,))
"""One declaration, shared by the four strategies here (one key, one meaning)."""


@dataclass
class FedAdamConfig(FedAvgConfig):
    """Flower's ``FedAdam`` arguments and defaults."""

    eta: float = field(default=1e-1, metadata={"gt": 0.0})
    """Server learning rate."""
    beta_1: float = field(default=0.9, metadata={"ge": 0.0, "lt": 1.0})
    """First-moment (momentum) decay."""
    beta_2: float = field(default=0.99, metadata={"ge": 0.0, "lt": 1.0})
    """Second-moment decay."""
    tau: float = field(default=1e-3, metadata={"gt": 0.0})
    """Adaptivity: added to sqrt(v_t) in the denominator."""


@dataclass
class FedYogiConfig(FedAdamConfig):
    """Flower's ``FedYogi`` arguments and defaults."""

    eta: float = field(default=1e-2, metadata={"gt": 0.0})
    """Server learning rate."""


@dataclass
class FedAdagradConfig(FedAvgConfig):
    """Flower's ``FedAdagrad`` arguments and defaults (it fixes beta_1 = beta_2 = 0)."""

    eta: float = field(default=1e-1, metadata={"gt": 0.0})
    """Server learning rate."""
    tau: float = field(default=1e-3, metadata={"gt": 0.0})
    """Adaptivity: added to sqrt(v_t) in the denominator."""


@dataclass
class FedAvgMConfig(FedAvgConfig):
    """Flower's ``FedAvgM`` arguments and defaults (which make it FedAvg)."""

    server_learning_rate: float = field(default=1.0, metadata={"gt": 0.0})
    """eta: x_{t+1} = x_t - eta v_t."""
    server_momentum: float = field(default=0.0, metadata={"ge": 0.0, "lt": 1.0})
    """beta: v_t = beta v_{t-1} + (x_t - mean)."""


def _pick(arrays: NamedArrays, prefix: str, names: Iterable[str]) -> NamedArrays:
    """``arrays[prefix + name]`` for each of ``names`` present, keyed by name."""
    return {k: arrays[prefix + k] for k in names if prefix + k in arrays}


class ServerOptimiser:
    """What fedmech adds to a Flower server optimiser; listed before Flower's class in the
    bases, with ``WeightedFedAvg`` after it (``class X(ServerOptimiser, FedAdam,
    WeightedFedAvg)``), so Flower's ``super().aggregate_train`` is fedmech's mean.

    ``model`` holds the model's arrays in ``state_dict`` order (their names, order and dtypes
    are what the aggregate is returned in); ``buffers`` names its buffers; ``pruned``: the
    clients prune, so a parameter's zeros in the mean are pruned coordinates.
    """

    def __init__(self, model: NamedArrays, buffers: Collection[str] = (), pruned: bool = False,
                 weighting: str = "examples", **kwargs) -> None:
        super().__init__(**kwargs)
        self.weighting = weighting
        self.dtypes = {k: v.dtype for k, v in model.items()}
        self.buffers = set(buffers)
        self.pruned = pruned

    def average(self, server_round: int, contents: list[RecordDict], models: list[NamedArrays],
                weights: list[float]) -> tuple[NamedArrays, dict[str, int | float]]:
        """The mean, with the coordinates the step must leave at it held (before Flower's
        step, which runs after this returns): each buffer, and the mean's zeros in a
        parameter when the clients prune. The state's class (``FedOptState``,
        ``ResumableFedAvgM``) holds them: ``hold(held, mean)`` with bool masks by name
        makes x_t there the mean and the optimiser's state 0."""
        mean, own = super().average(server_round, contents, models, weights)
        held = {k: np.ones(v.shape, bool) if k in self.buffers else v == 0 for k, v in mean.items()
                if k in self.buffers or (self.pruned and np.issubdtype(v.dtype, np.floating))}
        if held := {k: m for k, m in held.items() if m.any()}:
            self.hold(held, mean)
        return mean, own

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, None
        stepped = from_record(arrays)
        out = {k: cast(stepped[k], dtype) for k, dtype in self.dtypes.items()}
        metrics[UPDATE_NORM] = l2_norm({k: out[k].astype(np.float64) - self.sent[k] for k, d in self.dtypes.items()
                                        if np.issubdtype(d, np.floating)})
        return to_record(out), metrics


class FedOptState:
    """FedAdam's, FedYogi's and FedAdagrad's state: the moments m_t and v_t (None before
    the first aggregation; Flower holds a 0-d array's moments as NumPy scalars).
    ``current_arrays`` is not kept: ``configure_train`` sets it from the model sent each
    round."""

    def hold(self, held: dict[str, np.ndarray], mean: NamedArrays) -> None:
        for name, mask in held.items():
            self.current_arrays[name] = np.where(mask, mean[name], self.current_arrays[name])
            for moments in (self.m_t, self.v_t):
                if moments:  # None before the first step: Flower starts them at 0
                    moments[name] = np.where(mask, 0.0, moments[name])

    def state_arrays(self) -> NamedArrays:
        return {f"{name}/{k}": np.asarray(v) for name in ("m_t", "v_t") for k, v in (getattr(self, name) or {}).items()}

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        self.m_t = _pick(arrays, "m_t/", self.dtypes) or None
        self.v_t = _pick(arrays, "v_t/", self.dtypes) or None


class ResumableFedAdam(ServerOptimiser, FedOptState, FedAdam, WeightedFedAvg):
    """Flower's FedAdam on fedmech's mean."""


class ResumableFedYogi(ServerOptimiser, FedOptState, FedYogi, WeightedFedAvg):
    """Flower's FedYogi on fedmech's mean."""


class ResumableFedAdagrad(ServerOptimiser, FedOptState, FedAdagrad, WeightedFedAvg):
    """Flower's FedAdagrad on fedmech's mean."""


class ResumableFedAvgM(ServerOptimiser, FedAvgM, WeightedFedAvg):
    """Flower's FedAvgM on fedmech's mean. Its state: the momentum vector (a list in the
    aggregate's array order; None until the first step with momentum) and its last
    aggregate ``current_arrays`` (the x_t of its next step; set from the first model sent)."""

    def hold(self, held: dict[str, np.ndarray], mean: NamedArrays) -> None:
        if self.current_arrays is None:
            return  # Flower raises: configure_train was not called
        current = from_record(self.current_arrays)
        for i, name in enumerate(current):
            if name in held:
                current[name] = np.where(held[name], mean[name], current[name])
                if self.momentum_vector is not None:
                    self.momentum_vector[i] = np.where(held[name], 0.0, self.momentum_vector[i])
        self.current_arrays = to_record(current)

    def state_arrays(self) -> NamedArrays:
        if self.current_arrays is None:
            return {}
        current = from_record(self.current_arrays)
        state = {f"current_arrays/{k}": v for k, v in current.items()}
        if self.momentum_vector is not None:
            state.update({f"momentum_vector/{k}": np.asarray(v) for k, v in zip(current, self.momentum_vector, strict=True)})
        return state

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        current = _pick(arrays, "current_arrays/", self.dtypes)
        momentum = _pick(arrays, "momentum_vector/", self.dtypes)
        self.current_arrays = to_record(current) if current else None
        self.momentum_vector = list(momentum.values()) if momentum else None


def _flower_kwargs(params: FedAvgConfig, ctx: StrategyContext) -> dict:
    """The factory's arguments: the model and its buffers, whether the clients prune, the
    weighting, Flower's own and OFFERED_NODES_ONLY."""
    own = {k: v for k, v in vars(params).items() if k != "weighting"}
    buffers = set(ctx.initial) - set(parameter_names(ctx))
    return {"model": ctx.initial, "buffers": buffers, "pruned": ctx.pruned, "weighting": params.weighting, **own,
            **OFFERED_NODES_ONLY}


@STRATEGIES.register("fedadam", FedAdamConfig, outputs=OUTPUTS)
def fedadam(params: FedAdamConfig, ctx: StrategyContext) -> ResumableFedAdam:
    """Flower's FedAdam (Reddi et al. 2021, ICLR, arXiv:2003.00295), resumable."""
    return ResumableFedAdam(**_flower_kwargs(params, ctx))


@STRATEGIES.register("fedyogi", FedYogiConfig, outputs=OUTPUTS)
def fedyogi(params: FedYogiConfig, ctx: StrategyContext) -> ResumableFedYogi:
    """Flower's FedYogi (Reddi et al. 2021, ICLR, arXiv:2003.00295), resumable."""
    return ResumableFedYogi(**_flower_kwargs(params, ctx))


@STRATEGIES.register("fedadagrad", FedAdagradConfig, outputs=OUTPUTS)
def fedadagrad(params: FedAdagradConfig, ctx: StrategyContext) -> ResumableFedAdagrad:
    """Flower's FedAdagrad (Reddi et al. 2021, ICLR, arXiv:2003.00295), resumable."""
    return ResumableFedAdagrad(**_flower_kwargs(params, ctx))


@STRATEGIES.register("fedavgm", FedAvgMConfig, outputs=OUTPUTS)
def fedavgm(params: FedAvgMConfig, ctx: StrategyContext) -> ResumableFedAvgM:
    """Flower's FedAvgM, server momentum (Hsu et al. 2019, arXiv:1909.06335), resumable."""
    return ResumableFedAvgM(**_flower_kwargs(params, ctx))
