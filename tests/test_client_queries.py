"""A strategy with its own client side, defined here and not in the core: it registers a
client query and a strategy that sends it, and a real in-process run gets the answers."""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from conftest import smoke_config
from fedmech_flwr.app.client_app import app as client_app
from fedmech_flwr.app.inprocess import InProcessGrid, run_in_process
from fedmech_flwr.contracts.strategy import CLIENT_QUERIES, OFFERED_NODES_ONLY, STRATEGIES, QueryContext, StrategyContext
from fedmech_flwr.contracts.wire import query_nodes
from fedmech_flwr.learning.arrays import load_arrays

CENSUS = "label_census"
ANSWERS: dict[int, dict[int, MetricRecord]] = {}
"""What the strategy heard, by round and partition-id."""


@CLIENT_QUERIES.register(CENSUS)
def census(ctx: QueryContext) -> RecordDict:
    """The client's label histogram and the head bias of the model it was sent."""
    return RecordDict({"census": MetricRecord({
        "partition-id": ctx.partition_id,
        "round": ctx.server_round,
        "histogram": torch.bincount(ctx.y, minlength=ctx.num_classes).tolist(),
        "head-bias": ctx.model.state_dict()["head.bias"].tolist(),
        "asked": int(ctx.config["asked"]),
    })})


class CensusFedAvg(FedAvg):
    """FedAvg that sends each round's aggregate back to its clients in ``query.label_census``."""

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(**OFFERED_NODES_ONLY)
        self.ctx = ctx

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = super().configure_train(server_round, arrays, config, grid)
        self._grid, self._config = grid, config
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        nodes = [r.metadata.src_node_id for r in replies if not r.has_error()]
        query = ConfigRecord({**dict(self._config), "asked": len(nodes)})
        for answer in query_nodes(self._grid, nodes, CENSUS, arrays, query, self.ctx.round_timeout_s):
            record = answer.content["census"]
            ANSWERS.setdefault(server_round, {})[int(record["partition-id"])] = record
        return arrays, metrics


STRATEGIES.register("census_fedavg")(lambda params, ctx: CensusFedAvg(ctx))


def test_a_strategy_from_a_test_module_gets_its_clients_answers(tmp_path):
    ANSWERS.clear()
    run = run_in_process(smoke_config(["strategy={name: census_fedavg}"]), tmp_path)
    clients = json.loads((run / "partitions.json").read_text())["clients"]
    assert sorted(ANSWERS) == [1, 2]
    for server_round, answers in ANSWERS.items():
        assert sorted(answers) == [c["partition_id"] for c in clients]
        for c in clients:
            answer = answers[c["partition_id"]]
            assert answer["round"] == server_round and answer["asked"] == len(clients)
            assert answer["histogram"] == c["label_histogram"]
    final_bias = load_arrays(run / "model_final.safetensors")["head.bias"]
    for answer in ANSWERS[2].values():  # the clients were sent the final aggregate
        np.testing.assert_array_equal(np.asarray(answer["head-bias"], dtype=final_bias.dtype), final_bias)


def test_an_unknown_client_query_is_refused_naming_the_registered_ones():
    (reply,) = query_nodes(InProcessGrid(client_app, 1), [1000], "label_censsus", ArrayRecord(), ConfigRecord(), 10.0)
    assert reply.has_error()
    assert "unknown client query 'label_censsus'; did you mean 'label_census'?" in reply.error.reason
    assert "registered: class_stats, label_census" in reply.error.reason
