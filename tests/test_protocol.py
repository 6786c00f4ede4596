"""The round protocol: seeded sampling, failure policy, partition-id order, discovery."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from conftest import outgoing, train_reply
from fedmech_flwr.app import ray_actors
from fedmech_flwr.app.client_app import app as client_app
from fedmech_flwr.app.inprocess import InProcessGrid
from fedmech_flwr.app.protocol import (
    NODE_PROVIDED,
    SHARD,
    ClientFailure,
    NodeInfo,
    RoundProtocol,
    RoundSummary,
    discover_nodes,
    simulated_roster,
)
from fedmech_flwr.app.ray_actors import RayNodeLost
from fedmech_flwr.builtin.strategies.fedavg import WeightedFedAvg
from fedmech_flwr.contracts.strategy import OFFERED_NODES_ONLY
from fedmech_flwr.contracts.wire import CLIENT_STATE_KEY, CONFIG_KEY, DATA_SPEC_KEY, IDENTIFY_ACTION
from fedmech_flwr.datasets.data import DatasetBundle
from fedmech_flwr.foundation.seeds import numpy_rng
from fedmech_flwr.learning.arrays import from_record, pack, to_record

# Node ids deliberately out of partition order: sorting by node id would give 1, 2, 0.
PARTITIONS = {0: 1005, 1: 1001, 2: 1003}


class Recorder:
    """Stands in for the RunFolder: keeps what the protocol writes."""

    def __init__(self) -> None:
        self.clients, self.failures, self.aggregates = [], [], []

    def client(self, server_round, update):
        self.clients.append((server_round, update.partition_id, update.num_examples))

    def failure(self, server_round, partition_id, reason, policy, details="", ray_node=None):
        self.failures.append({"round": server_round, "partition_id": partition_id, "reason": reason, "policy": policy,
                              **({"ray_node": ray_node} if ray_node else {})})

    def strategy(self, server_round, metrics):
        self.aggregates.append((server_round, metrics))


class OrderRecordingFedAvg(WeightedFedAvg):
    """The real FedAvg, noting the partition-ids of the replies in the order it gets them."""

    def __init__(self) -> None:
        super().__init__()
        self.orders: list[list[int]] = []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.orders.append([int(r.content["report"]["partition-id"]) for r in replies])
        return super().aggregate_train(server_round, replies)


def protocol(cfg, strategy=None, partitions=PARTITIONS, recorder=None):
    proto = RoundProtocol(strategy or OrderRecordingFedAvg(), cfg, dict(partitions), recorder or Recorder())
    proto.current = RoundSummary(1, tuple(sorted(partitions)))
    return proto


def arrays_of(partition_id: int) -> dict[str, np.ndarray]:
    return {"w": np.full(3, float(partition_id + 1), np.float32)}


def reply(messages, partition_id, **kw):
    return messages.train(PARTITIONS[partition_id], arrays_of(partition_id), 10 * (partition_id + 1),
                          partition_id=partition_id, **kw)


# --- sampling ---------------------------------------------------------------------------

def test_sample_is_deterministic_sorted_and_sized(make_cfg):
    cfg = make_cfg("federation.num_clients=10", "federation.clients_per_round=3")
    proto = protocol(cfg, partitions={p: 2000 + p for p in range(10)})
    draws = [proto.sample(r) for r in range(1, 11)]
    for draw in draws:
        assert len(draw) == 3 and len(set(draw)) == 3
        assert draw == sorted(draw) and all(isinstance(p, int) and 0 <= p < 10 for p in draw)
    again = protocol(cfg, partitions={p: 2000 + p for p in range(10)})
    assert [again.sample(r) for r in range(1, 11)] == draws  # same (seed, round), same clients
    assert len({tuple(d) for d in draws}) > 3  # rounds differ
    other_seed = protocol(make_cfg("seed=1", "federation.num_clients=10", "federation.clients_per_round=3"),
                          partitions={p: 2000 + p for p in range(10)})
    assert [other_seed.sample(r) for r in range(1, 11)] != draws


def test_sample_known_answer(make_cfg):
    cfg = make_cfg("federation.num_clients=10", "federation.clients_per_round=3")
    expected = sorted(int(p) for p in numpy_rng(0, "client-sampling", None, 4).choice(list(range(10)), 3, replace=False))
    assert protocol(cfg, partitions={p: p for p in range(10)}).sample(4) == expected == [0, 2, 5]


def test_sample_all_when_null(smoke_cfg):
    assert smoke_cfg.federation.clients_per_round is None
    proto = protocol(smoke_cfg)
    assert proto.sample(1) == proto.sample(5) == [0, 1, 2]


# --- failure policy ---------------------------------------------------------------------

def test_error_reply_with_fail_policy_raises_naming_client_and_fix(smoke_cfg, messages):
    rec = Recorder()
    proto = protocol(smoke_cfg, recorder=rec)
    replies = [reply(messages, 0), messages.error(PARTITIONS[1], "boom"), reply(messages, 2)]
    with pytest.raises(ClientFailure) as info:
        proto.aggregate_train(1, replies)
    msg = str(info.value)
    assert "round 1: client 1 failed (raised: boom)" in msg
    assert "on_client_failure is 'fail'" in msg and "'continue'" in msg
    assert rec.failures == [{"round": 1, "partition_id": 1, "reason": "raised: boom", "policy": "fail"}]
    assert rec.clients == []


def test_continue_policy_aggregates_the_rest_and_records_failure(make_cfg, messages):
    rec = Recorder()
    strategy = OrderRecordingFedAvg()
    proto = protocol(make_cfg("federation.on_client_failure=continue"), strategy, recorder=rec)
    replies = [reply(messages, 2), messages.error(PARTITIONS[1], "boom"), reply(messages, 0)]
    arrays, metrics = proto.aggregate_train(1, replies)
    # weights 10 (partition 0, value 1) and 30 (partition 2, value 3): (10 * 1 + 30 * 3) / 40 = 2.5
    np.testing.assert_allclose(from_record(arrays)["w"], [2.5, 2.5, 2.5])
    assert strategy.orders == [[0, 2]]
    assert rec.failures == [{"round": 1, "partition_id": 1, "reason": "raised: boom", "policy": "continue"}]
    assert rec.clients == [(1, 0, 10), (1, 2, 30)]
    assert proto.current.succeeded == (0, 2)


def test_missing_reply_counts_as_failure(make_cfg, messages):
    rec = Recorder()
    proto = protocol(make_cfg("federation.on_client_failure=continue", "federation.round_timeout_s=5"), recorder=rec)
    proto.aggregate_train(1, [reply(messages, 0), reply(messages, 1)])
    assert rec.failures == [{"round": 1, "partition_id": 2, "reason": "timeout: no reply within 5s", "policy": "continue"}]


def test_fewer_than_min_replies_raises(make_cfg, messages):
    cfg = make_cfg("federation.on_client_failure=continue", "federation.min_replies=2")
    rec = Recorder()
    replies = [messages.error(PARTITIONS[0], "a"), reply(messages, 1), messages.error(PARTITIONS[2], "c")]
    with pytest.raises(ClientFailure, match="round 1: only 1 successful replies, federation.min_replies is 2"):
        protocol(cfg, recorder=rec).aggregate_train(1, replies)
    assert [f["partition_id"] for f in rec.failures] == [0, 2]


def test_replies_reach_strategy_in_partition_order(smoke_cfg, messages):
    results = []
    for arrival in ([2, 0, 1], [1, 2, 0], [0, 1, 2]):
        strategy = OrderRecordingFedAvg()
        proto = protocol(smoke_cfg, strategy)
        arrays, _ = proto.aggregate_train(1, [reply(messages, p) for p in arrival])
        assert strategy.orders == [[0, 1, 2]]
        results.append(from_record(arrays)["w"].tobytes())
    assert len(set(results)) == 1  # bitwise the same aggregate whatever the arrival order


def test_strategy_returning_nothing_fails_clearly(smoke_cfg, messages):
    class NoModel(WeightedFedAvg):
        def aggregate_train(self, server_round, replies):
            return None, None

    with pytest.raises(ClientFailure, match="round 1: NoModel returned no aggregated model"):
        protocol(smoke_cfg, NoModel()).aggregate_train(1, [reply(messages, p) for p in range(3)])


def test_post_aggregate_is_applied(smoke_cfg, messages):
    proto = RoundProtocol(WeightedFedAvg(), smoke_cfg, PARTITIONS, Recorder(),
                          post_aggregate=lambda arrays: {k: np.zeros_like(v) for k, v in arrays.items()})
    proto.current = RoundSummary(1, (0, 1, 2))
    arrays, _ = proto.aggregate_train(1, [reply(messages, p) for p in range(3)])
    assert not from_record(arrays)["w"].any()


# --- discovery --------------------------------------------------------------------------

def discover(grid: InProcessGrid, expected: int, timeout: float = 5):
    """``discover_nodes`` with the smoke experiment's config and data spec (4 classes, 1x12x12)."""
    from flwr.app import ConfigRecord

    from conftest import smoke_config
    from fedmech_flwr.app.node_data import NodeDataSpec
    from fedmech_flwr.spec.experiment import load_data

    cfg = smoke_config()
    bundle: DatasetBundle = load_data(cfg)
    config = ConfigRecord({CONFIG_KEY: cfg.to_json(), DATA_SPEC_KEY: NodeDataSpec.of(bundle).to_json()})
    return discover_nodes(grid, expected, timeout, config, bundle.num_classes)


def test_discover_maps_partition_to_node():
    roster = discover(InProcessGrid(client_app, 3), 3)
    assert roster.node_ids == {0: 1000, 1: 1001, 2: 1002}
    assert {info.source for info in roster.clients.values()} == {SHARD} and roster.refused == []


def test_own_data_nodes_take_the_free_ids_in_the_order_of_their_names(tmp_path):
    x, y = np.zeros((20, 12, 12), np.float32), np.arange(20) % 4
    np.savez(tmp_path / "own.npz", x=x, y=y)
    own = lambda name: {"data-path": str(tmp_path / "own.npz"), "node-name": name}  # noqa: E731
    grid = InProcessGrid(client_app, 4, node_configs=[
        own("zurich"), {"partition-id": 1, "num-partitions": 4}, own("athens"), {"partition-id": 3, "num-partitions": 4},
    ])
    roster = discover(grid, 4)
    assert roster.node_ids == {0: 1002, 1: 1001, 2: 1000, 3: 1003}  # athens < zurich take the free ids 0 and 2
    assert roster.clients[0] == NodeInfo(1002, NODE_PROVIDED, "athens", 20, (5, 5, 5, 5))
    assert roster.clients[1].source == SHARD
    assert roster.ids_json() == '{"1002": 0, "1000": 2}'  # shard nodes know their id: only own-data nodes are told


@pytest.mark.parametrize(
    "nodes, timeout, message",
    [
        (4, 5, "4 SuperNodes are connected but federation.num_clients is 3"),  # too many
        (2, 1, "only 2 of 3 SuperNodes connected within 1s"),  # too few: times out
    ],
)
def test_discover_wrong_node_count(nodes, timeout, message):
    grid = InProcessGrid(client_app, nodes)
    with pytest.raises(ClientFailure) as info:
        discover(grid, 3, timeout=timeout)
    assert message in str(info.value)
    assert "num-supernodes=3" in str(info.value)


def test_discover_duplicate_partition_id():
    grid = InProcessGrid(client_app, 3)
    grid.contexts[1002].node_config["partition-id"] = 0
    with pytest.raises(ClientFailure, match="two nodes claim partition-id 0"):
        discover(grid, 3)


def test_discover_duplicate_node_name(tmp_path):
    np.savez(tmp_path / "own.npz", x=np.zeros((20, 12, 12), np.float32), y=np.arange(20) % 4)
    same = {"data-path": str(tmp_path / "own.npz"), "node-name": "lab"}
    with pytest.raises(ClientFailure, match="two nodes are called 'lab'; give each its own node-name"):
        discover(InProcessGrid(client_app, 2, node_configs=[same, same]), 2)


def test_discover_node_with_wrong_num_partitions():
    grid = InProcessGrid(client_app, 3)
    grid.contexts[1001].node_config["num-partitions"] = 5
    with pytest.raises(ClientFailure, match="node 1001 says num-partitions=5, but federation.num_clients is 3"):
        discover(grid, 3)


def test_discover_refuses_a_node_that_errors():
    broken = ClientApp()

    @broken.query(IDENTIFY_ACTION)
    def identify(msg: Message, context: Context) -> Message:
        if context.node_id == 1000:
            raise RuntimeError("no partition here")
        return client_app(msg, context)

    roster = discover(InProcessGrid(broken, 2), 2)
    assert [(node, reason) for node, reason, _ in roster.refused] == [(1000, "raised: RuntimeError: no partition here")]
    assert roster.node_ids == {1: 1001}


def simulation_grid(num_nodes: int):
    """Flower's simulation Grid over a link state where Flower's simulation engine
    registered ``num_nodes`` nodes; and the engine's ``{node_id: partition-id}``."""
    from dataclasses import replace

    from flwr.proto.task_pb2 import Task
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run as FlowerRun
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    run = replace(FlowerRun.create_empty(7), primary_task_id=1, federation_id=NOOP_FEDERATION_ID)
    state = factory.state()  # the run registered as Flower's simulation does
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return grid, _register_nodes(num_nodes, factory)


def test_simulated_roster_is_the_simulation_engines_partition_ids():
    """Flower gives its i-th registered node partition-id i; the roster holds the same
    map (node ids are random, so sorting them would not)."""
    grid, partition_of = simulation_grid(50)
    roster = simulated_roster(grid, 50, timeout=1)
    assert roster.node_ids == {partition_id: node for node, partition_id in partition_of.items()}
    assert {info.source for info in roster.clients.values()} == {SHARD} and roster.refused == []
    assert roster.ids_json() == "{}"


def test_simulated_roster_checks_the_node_count_and_needs_the_simulation():
    with pytest.raises(ClientFailure, match="4 SuperNodes are connected but federation.num_clients is 3"):
        simulated_roster(simulation_grid(4)[0], 3, timeout=1)
    assert simulated_roster(InProcessGrid(client_app, 3), 3, timeout=1) is None  # real nodes are asked


def test_reply_from_another_client_than_sampled_stops_the_run(smoke_cfg, messages):
    """A node that trained another partition than the roster says (a roster that does not
    match the federation) fails the round, whatever the failure policy."""
    proto = protocol(smoke_cfg)
    wrong = messages.train(PARTITIONS[0], arrays_of(0), 10, partition_id=2)
    with pytest.raises(ClientFailure, match=f"node {PARTITIONS[0]} was sampled as client 0 but replied as client 2"):
        proto.aggregate_train(1, [wrong, reply(messages, 1), reply(messages, 2)])


# --- faults screened before aggregation, resume -----------------------------------------

def test_non_finite_reply_is_dropped_before_the_strategy_sees_it(make_cfg, messages):
    rec = Recorder()
    strategy = OrderRecordingFedAvg()
    proto = protocol(make_cfg("federation.on_client_failure=continue"), strategy, recorder=rec)
    bad = messages.train(PARTITIONS[1], {"w": np.array([1, np.nan, np.inf], np.float32)}, 20, partition_id=1)
    arrays, _ = proto.aggregate_train(1, [reply(messages, 2), bad, reply(messages, 0)])
    assert strategy.orders == [[0, 2]]
    np.testing.assert_allclose(from_record(arrays)["w"], [2.5, 2.5, 2.5])  # as if client 1 never answered
    assert rec.failures == [{"round": 1, "partition_id": 1, "reason": "non-finite weights in w", "policy": "continue"}]
    assert rec.clients == [(1, 0, 10), (1, 2, 30)]


def test_error_that_is_not_a_client_exception_keeps_flowers_code(make_cfg, flower_identity):
    rec = Recorder()
    proto = protocol(make_cfg("federation.on_client_failure=continue"), recorder=rec)
    unavailable = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node gone"), reply_to=outgoing(PARTITIONS[0]))
    proto.aggregate_train(1, [unavailable, *(train_reply(PARTITIONS[p], arrays_of(p), 10, partition_id=p) for p in (1, 2))])
    assert rec.failures[0]["reason"] == f"error {ErrorCode.NODE_UNAVAILABLE}: node gone"


def test_a_client_lost_with_its_ray_node_is_recorded_with_the_node(make_cfg, flower_identity):
    """Flower's simulation wraps the ``RayNodeLost`` of ``ray_actors`` as any exception;
    the failure record names the node, and so does the error of a run that must stop."""
    lost = RayNodeLost("Ray node 3e90 (10.0.0.7) lost client 0's actor (ActorUnavailableError); 1 actor(s) left")
    error = Error(code=ErrorCode.UNKNOWN, reason=f"{type(lost)}:<'{lost}'>")  # vce_api's wrapping
    replies = [Message(error, reply_to=outgoing(PARTITIONS[0])),
               *(train_reply(PARTITIONS[p], arrays_of(p), 10, partition_id=p) for p in (1, 2))]
    rec = Recorder()
    protocol(make_cfg("federation.on_client_failure=continue"), recorder=rec).aggregate_train(1, replies)
    assert rec.failures == [{"round": 1, "partition_id": 0, "policy": "continue", "ray_node": "3e90",
                             "reason": f"error {ErrorCode.UNKNOWN}: RayNodeLost: {lost}"}]
    with pytest.raises(ClientFailure, match=r"client 0 failed \(error 0: RayNodeLost: Ray node 3e90 \(10.0.0.7\) lost"):
        protocol(make_cfg()).aggregate_train(1, replies)


def test_ray_actors_replace_flowers_method_only_in_its_simulation_and_version(monkeypatch, caplog):
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    caplog.set_level("INFO", logger=ray_actors.__name__)
    flowers = RayBackend.process_message
    monkeypatch.setattr(RayBackend, "process_message", flowers)  # restored after the test
    assert not ray_actors.install(InProcessGrid(client_app, 3))
    assert not ray_actors.install(simulation_grid(1)[0], version="1.43.0")
    assert RayBackend.process_message is flowers and "Flower 1.43.0" in caplog.text
    assert ray_actors.install(simulation_grid(1)[0], version=ray_actors.FLOWER_VERSION)
    assert RayBackend.process_message is ray_actors.process_message


class StatefulFedAvg(WeightedFedAvg):
    def __init__(self) -> None:
        super().__init__()
        self.memory = {"m": np.arange(3.0)}

    def state_arrays(self):
        return self.memory

    def load_state_arrays(self, arrays):
        self.memory = arrays


def test_resumed_protocol_shifts_rounds(smoke_cfg, messages):
    rec = Recorder()
    proto = RoundProtocol(WeightedFedAvg(), smoke_cfg, PARTITIONS, rec, resume_after=2)
    proto.current = RoundSummary(3, (0, 1, 2))
    proto.aggregate_train(1, [reply(messages, p) for p in range(3)])  # Flower's round 1 is round 3
    assert [server_round for server_round, _, _ in rec.clients] == [3, 3, 3]


def test_a_runs_resumable_state_is_saved_and_restored(smoke_cfg, tmp_path):
    """The strategy's state under ``strategy/``; a fresh run gets it back."""
    from flwr.app import ConfigRecord

    from fedmech_flwr.app.run import Run, RunInputs

    def run():
        return Run(RunInputs(smoke_cfg, {}, StatefulFedAvg(), None, None, 4, [], {}, ConfigRecord(), tmp_path))

    assert list(run().state()) == ["strategy/m"]
    fresh = run()
    fresh.restore({"strategy/m": np.ones(3)})
    np.testing.assert_array_equal(fresh.inputs.strategy.memory["m"], np.ones(3))


# --- clients' own state -------------------------------------------------------------------

def test_a_resumed_runs_clients_get_their_state_back_until_they_reply(make_cfg, messages):
    """After a resume every node starts empty: a client's first train message carries the
    state the server saved for it, and only until the client replied in this run (then its
    node holds it). Messages sharing one content are not changed for the other clients."""
    cfg = make_cfg("federation.on_client_failure=continue")
    proto = RoundProtocol(WeightedFedAvg(**OFFERED_NODES_ONLY), cfg, PARTITIONS, Recorder(), resume_after=2)
    saved = {"0/c": np.full(2, 0.5, np.float32), "2/c": np.full(2, 2.5, np.float32)}
    proto.load_state_arrays(saved)
    grid = InProcessGrid(ClientApp(), 6)

    def carried() -> dict[int, np.ndarray]:
        sent = proto.configure_train(1, to_record(arrays_of(0)), ConfigRecord(), grid)
        by_partition = {proto.node_to_partition[m.metadata.dst_node_id]: m.content for m in sent}
        assert all("arrays" in content for content in by_partition.values())
        return {partition_id: from_record(c[CLIENT_STATE_KEY])["c"]
                for partition_id, c in by_partition.items() if CLIENT_STATE_KEY in c}

    first = carried()
    assert sorted(first) == [0, 2] and first[0].tolist() == [0.5, 0.5] and first[2].tolist() == [2.5, 2.5]
    new_state = ConfigRecord({CLIENT_STATE_KEY: pack({"c": np.full(2, 7.0, np.float32)})})
    client_0 = reply(messages, 0)
    client_0.content["report"][CLIENT_STATE_KEY] = new_state[CLIENT_STATE_KEY]
    proto.aggregate_train(1, [client_0, reply(messages, 1)])  # client 2 did not reply
    assert list(carried()) == [2]  # client 0's node holds its state now
    assert proto.state_arrays() == {"0/c": pytest.approx(np.full(2, 7.0)), "2/c": saved["2/c"]}
