"""FedBABU (Oh et al. 2022, arXiv:2106.06042): federate the body, keep the head at init.

The head is frozen at its random initialisation during federated training; only the body
is trained and aggregated, so the body learns features that a fixed head reads. The client
must be ``fedbabu`` (it freezes the head during local training); the strategy also puts
the initial head back into every aggregate, so no client can move it.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, MetricRecord

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


class FedBABU(WeightedFedAvg):
    """FedAvg of the body; the aggregate's head is always ``initial_head``."""

    def __init__(self, initial_head: NamedArrays, weighting: str = "examples", **kwargs) -> None:
        super().__init__(weighting=weighting, **kwargs)
        self.initial_head = initial_head

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, None
        return to_record({**from_record(arrays), **self.initial_head}), metrics


@STRATEGIES.register("fedbabu", FedAvgConfig, pairs_with=("fedbabu",))
def fedbabu(params: FedAvgConfig, ctx: StrategyContext) -> FedBABU:
    names = ctx.build_model(ctx.initial).head_parameter_names()
    head = {k: v.copy() for k, v in ctx.initial.items() if k in names}
    return FedBABU(head, weighting=params.weighting, **OFFERED_NODES_ONLY)
