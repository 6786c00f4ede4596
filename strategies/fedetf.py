"""FedETF (Li et al. 2023, ICCV, arXiv:2303.10058, "No Fear of Classifier Biases: Neural
Collapse Inspired Federated Learning with Synthetic and Fixed Classifier").

Neural collapse says a well-trained classifier's class vectors form a simplex equiangular
tight frame (ETF). FedETF fixes the head at a random simplex ETF from the start, so no
client can bias it towards its own classes, and federates only the body, which learns
features that the fixed head reads. The head's weight W [K, d] is

    W^T = sqrt(K / (K - 1)) * U (I_K - (1/K) 1 1^T),

U [d, K] with orthonormal columns (QR of a seeded Gaussian matrix, seed
``seed_for(run seed, "etf")``), and its bias is 0. Every class vector has unit norm, any
two have cosine -1/(K - 1), and they sum to zero. K vectors need d >= K here (U has K
orthonormal columns): the check refuses a model with fewer penultimate features than
classes.

The run starts from the initial body with the ETF head (``initial_model``), so round 0
evaluates the model the method begins with, not the random head; the strategy sends the ETF
head with the global model every round and puts it back into every aggregate; the client
(``etf``) keeps it frozen and trains the body on the ETF logits W h / (T ||h||). The
server evaluates model(x) = W h, which has the same argmax as W h / ||h||: the feature
normalisation and the temperature change the training loss, not the accuracy.

Not here: the paper's projection layer before the normalisation, its learnable temperature
(see ``clients/etf.py``) and its local personalisation stage (fine-tuning the ETF and the
projection per client); this is the global model's training.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, numpy_rng
from fedmech_flwr.api.model import FedMechModel, build_model
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


def simplex_etf(num_classes: int, dim: int, seed: int) -> np.ndarray:
    """The simplex ETF W [K, d] of ``num_classes`` K in ``dim`` d >= K dimensions (float64):
    rows of unit norm, pairwise cosine -1/(K - 1), summing to zero; U is drawn from the
    run seed's ``etf`` stream."""
    u, _ = np.linalg.qr(numpy_rng(seed, "etf").standard_normal((dim, num_classes)))
    k = num_classes
    return (np.sqrt(k / (k - 1)) * u @ (np.eye(k) - np.ones((k, k)) / k)).T


def etf_head(model: FedMechModel, seed: int) -> NamedArrays:
    """The model's head arrays (state_dict names and dtypes) holding the simplex ETF and a
    zero bias."""
    state = model.state_dict()
    head = {}
    for name in sorted(model.head_parameter_names()):
        dtype = state[name].detach().cpu().numpy().dtype
        if name.endswith(".weight"):
            head[name] = simplex_etf(model.num_classes, model.feature_dim, seed).astype(dtype)
        else:
            head[name] = np.zeros(tuple(state[name].shape), dtype=dtype)
    return head


class FedETF(WeightedFedAvg):
    """FedAvg of the body; every model sent and every aggregate has the ETF head
    ``initial_head`` (FedBABU's rule, with the ETF as the head it keeps)."""

    def __init__(self, initial_head: NamedArrays, weighting: str = "examples", **kwargs) -> None:
        super().__init__(weighting=weighting, **kwargs)
        self.initial_head = initial_head

    def initial_model(self, initial: NamedArrays) -> NamedArrays:
        """The initial body under the ETF head: the run's round 0 (``StartsFromItsOwnModel``)."""
        return {**initial, **self.initial_head}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return super().configure_train(server_round, to_record(self.initial_model(from_record(arrays))), config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, None
        return to_record({**from_record(arrays), **self.initial_head}), metrics


def check_fedetf(params: FedAvgConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """The ETF's K orthonormal directions need at least K penultimate features."""
    with torch.random.fork_rng(devices=[]):  # a check leaves the caller's random state alone
        model = build_model(cfg.model.name, cfg.model.params, in_channels=data.input_shape[0],
                            num_classes=data.num_classes, image_size=data.input_shape[1])
    if model.feature_dim < data.num_classes:
        raise ConfigError(
            f"fedetf fixes the head at a simplex ETF of {data.num_classes} class vectors built from "
            f"{data.num_classes} orthonormal directions, but model '{cfg.model.name}' has only "
            f"{model.feature_dim} penultimate features; choose a model (model.name or its widths) with "
            f"at least {data.num_classes} features",
            where,
        )


@STRATEGIES.register("fedetf", FedAvgConfig, pairs_with=("etf",), check=check_fedetf)
def fedetf(params: FedAvgConfig, ctx: StrategyContext) -> FedETF:
    return FedETF(etf_head(ctx.build_model(ctx.initial), ctx.seed), weighting=params.weighting, **OFFERED_NODES_ONLY)
