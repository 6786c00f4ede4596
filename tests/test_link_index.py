"""The per-node message index (``fedmech_flwr.app.link_index``) returns what Flower's own
``InMemoryLinkState.get_message_ins`` returns, on the same stored messages, and stays out of
the way on another Flower version."""

from __future__ import annotations

import copy
import datetime as dt
import time
from queue import Queue

import pytest
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory, in_memory_linkstate
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.simulation.run_simulation import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.federation.noop_federation_manager import NOOP_FEDERATION_ID

from conftest import outgoing
from fedmech_flwr.app import link_index

RUNS = (1, 2)
NODES = 12


def simulation_state(num_nodes: int = NODES) -> tuple[InMemoryLinkState, list[int]]:
    """A link state as Flower's simulation builds it (its runs, then its nodes registered by
    the simulation engine's own function), and the node ids in registration order."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    for run_id in RUNS:
        run = Run.create_empty(run_id=run_id)
        run.primary_task_id = run_id
        run.federation_id = NOOP_FEDERATION_ID
        state.run_ids[run_id] = RunRecord(run=run)
        state.task_store[run_id] = Task(task_id=run_id, run_id=run_id)
    return state, list(vce_api._register_nodes(num_nodes, factory))


def message(number: int, node: int, run_id: int = 1, ttl: float = 3600.0, created_at: float = 0.0):
    msg = outgoing(node)
    msg.metadata.__dict__["_message_id"] = f"m{number}"
    msg.metadata.__dict__["_run_id"] = run_id
    msg.metadata.ttl = ttl
    msg.metadata.created_at = created_at
    return msg


@pytest.fixture
def clock(monkeypatch):
    """Flower's link-state clock, moved by the test: [seconds since the start]."""
    start = time.time()
    offset = [0.0]
    monkeypatch.setattr(in_memory_linkstate, "now",
                        lambda: dt.datetime.fromtimestamp(start + offset[0], tz=dt.UTC))
    return start, offset


def test_the_index_returns_what_flower_returns_on_the_same_messages(flower_identity, clock):
    """Two identical link states, one polled by Flower's method and one by the index, through
    the simulation engine's pattern (every node, limit 1) and direct calls (no limit, one
    run), with messages stored between passes, some expiring and some deleted as a pulled
    reply deletes them: every call returns the same messages, stamped the same, and the
    stores end the same."""
    assert link_index.install()
    start, offset = clock
    flower, flower_nodes = simulation_state()
    indexed, indexed_nodes = simulation_state()
    mapping = dict(zip(indexed_nodes, flower_nodes))  # node ids are random: pair them by registration
    sent = 0

    def store(node_index: int, **kw) -> None:
        nonlocal sent
        msg = message(sent, indexed_nodes[node_index], created_at=start, **kw)
        twin = copy.deepcopy(msg)
        twin.metadata.dst_node_id = mapping[msg.metadata.dst_node_id]
        assert flower.store_message_ins(twin) == indexed.store_message_ins(msg) == f"m{sent}"
        sent += 1

    def poll(node: int, limit: int | None = 1, run_id: int | None = None) -> None:
        ours = link_index.get_message_ins(indexed, node, limit, run_id=run_id)
        theirs = link_index.FLOWER_GET_MESSAGE_INS(flower, mapping[node], limit, run_id=run_id)
        assert [(m.metadata.message_id, m.metadata.delivered_at) for m in ours] == \
               [(m.metadata.message_id, m.metadata.delivered_at) for m in theirs], (node, limit, run_id)
        calls.append(len(ours))

    calls: list[int] = []
    for i in range(3):
        store(0)  # three waiting for one node
    store(1, run_id=2)
    store(2, ttl=5.0)  # delivered, then expires
    store(3)
    store(4, run_id=2)
    for node in indexed_nodes:  # the engine's pass: one each
        poll(node)
    store(3)
    store(5, ttl=5.0)  # expires before its node is polled
    offset[0] = 10.0
    for node in indexed_nodes:
        poll(node)
    poll(indexed_nodes[0], limit=None)
    store(6)
    store(6, run_id=2)
    store(6)
    poll(indexed_nodes[6], limit=None, run_id=2)
    for ids in (["m0", "m3"], ["m7"]):  # replies pulled: Flower deletes the instructions
        flower.delete_messages(set(ids))
        indexed.delete_messages(set(ids))
    for _ in range(2):
        for node in indexed_nodes:
            poll(node)
    with pytest.raises(AssertionError, match="limit"):
        link_index.get_message_ins(indexed, indexed_nodes[0], 0)

    assert sum(calls) == sent - 1  # every message delivered once, but the one that expired first
    assert list(indexed.message_ins_store) == list(flower.message_ins_store)
    assert [m.metadata.delivered_at for m in indexed.message_ins_store.values()] == \
           [m.metadata.delivered_at for m in flower.message_ins_store.values()]
    by_node: dict[int, dict[str, None]] = {}
    for message_id, msg in indexed.message_ins_store.items():
        by_node.setdefault(msg.metadata.dst_node_id, {})[message_id] = None
    assert indexed.__dict__[link_index._INDEX] == by_node  # deleted messages left the index


def test_a_state_made_before_install_is_indexed_from_its_store(flower_identity):
    state, nodes = simulation_state()
    msg = message(0, nodes[3], created_at=time.time())
    link_index.FLOWER_STORE_MESSAGE_INS(state, msg)  # as before install: no index
    assert link_index.install()
    assert [m.metadata.message_id for m in state.get_message_ins(nodes[3], 1)] == ["m0"]
    assert state.get_message_ins(nodes[3], 1) == []


def test_another_flower_version_keeps_flowers_methods(caplog):
    caplog.set_level("INFO", logger=link_index.__name__)
    method = InMemoryLinkState.get_message_ins
    assert not link_index.install(version="1.43.0")
    assert InMemoryLinkState.get_message_ins is method
    assert "Flower 1.43.0: the per-node message index is written for Flower 1.42.0 and is not used" in caplog.text


class OnePass:
    """A stop event that lets a poller make one pass."""

    def __init__(self) -> None:
        self.asked = 0

    def is_set(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def wait(self, timeout: float) -> None:
        pass


def test_the_poller_queues_what_flowers_queues_in_the_same_order(flower_identity):
    """Flower's poller over every node and ours over the nodes the index names, one pass
    each on twin link states: the same messages, in the same (registration) order, though
    the messages were stored in another order; a node outside the engine's mapping is never
    asked, as Flower never asks it."""
    assert link_index.install()
    flower, flower_nodes = simulation_state()
    indexed, indexed_nodes = simulation_state()
    mapping = dict(zip(indexed_nodes, flower_nodes))
    for number, node_index in enumerate([7, 2, 2, 9, 0, 11, 5]):
        msg = message(number, indexed_nodes[node_index], created_at=time.time())
        twin = copy.deepcopy(msg)
        twin.metadata.dst_node_id = mapping[msg.metadata.dst_node_id]
        flower.store_message_ins(twin)
        indexed.store_message_ins(msg)
    queues = {}
    for name, poller, state, nodes in (("flower", link_index.FLOWER_POLLER, flower, flower_nodes),
                                       ("ours", link_index.add_messages_to_queue, indexed, indexed_nodes)):
        queue = Queue()
        poller(state, queue, {node: i for i, node in enumerate(nodes[:11])}, OnePass())  # node 11: not the engine's
        queues[name] = [queue.get_nowait().metadata.message_id for _ in range(queue.qsize())]
    assert queues["ours"] == queues["flower"] == ["m4", "m1", "m6", "m0", "m3"]
