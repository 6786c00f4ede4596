"""Ready-made ``check`` rules for a registration (``Registry.register(..., check=...)``).

A check is ``check(params, cfg, data, where)``: it raises a ConfigError naming ``where``
when the entry's ``params`` cannot work in the experiment ``cfg`` with data shaped like
``data``; every validation runs it, so a plug-in's own rules fail in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.spec.config import ExperimentConfig

Check = Callable[[object, ExperimentConfig, DataInfo, str], None]
"""A registration's ``check(params, cfg, data, where)``."""


def sgd_only(method: str, why: str) -> Check:
    """A ``check`` refusing any local optimizer but SGD: ``method`` ``why`` (the reason)."""
    def check(params: object, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
        if cfg.train.optimizer != "sgd":
            raise ConfigError(f"{method} {why}, but train.optimizer is {cfg.train.optimizer}; set train.optimizer=sgd",
                              where)
    return check


def plain_sgd_only(method: str, why: str) -> Check:
    """A ``check`` refusing any local optimizer but SGD without momentum: ``method`` takes
    plain SGD steps ``why`` (the reason, with the evidence)."""
    def check(params: object, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
        if cfg.train.optimizer != "sgd" or cfg.train.momentum != 0:
            raise ConfigError(f"{method} takes plain SGD steps, {why}, but train.optimizer is {cfg.train.optimizer} "
                              f"with train.momentum {cfg.train.momentum}; set train.optimizer=sgd and "
                              "train.momentum=0", where)
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
