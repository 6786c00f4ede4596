"""A per-node index of the instructions waiting in Flower's in-memory link state.

Flower's simulation engine polls every node for its next instruction ten times a second
(``vce_api.add_messages_to_queue``), and each poll (``InMemoryLinkState.get_message_ins``)
walks every stored instruction, checking each one's expiry: one pass over the federation
costs nodes x stored messages, and it holds the lock and the GIL that the ServerApp needs.
A round with 10 sampled clients out of 10,000 cost 2.87 times one out of 100
(docs/results/performance.md).

``install()``, for the Flower version it was written against only, replaces

- ``get_message_ins`` by one that visits only the polled node's own instructions, kept in
  an index beside Flower's store (filled where an instruction enters the store,
  ``store_message_ins``, its only writer; an entry leaves once Flower deleted its message);
- the engine's poller by one that asks only the nodes the index names, in Flower's order
  (registration), instead of every node: a pass over 100,000 idle nodes still cost 20 ms of
  the GIL every 0.1 s with the index alone.

Both hand out exactly what Flower's do (``tests/test_link_index.py`` runs them side by
side on the same stored messages). The poller is taken when the engine starts it; the
ServerApp installs both as its module is imported, before that, and a poller Flower
started earlier still gets the index. On any other Flower version Flower's own stay, with
one log line.
"""

from __future__ import annotations

import logging

import flwr
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import in_memory_linkstate
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

log = logging.getLogger(__name__)

FLOWER_VERSION = "1.42.0"
"""The Flower release whose ``get_message_ins`` this module reproduces, line for line."""

_INDEX = "_fedmech_waiting_by_node"
"""The link state's attribute holding the index: destination node id -> message ids, in the
order they were stored (a dict used as an ordered set)."""

FLOWER_GET_MESSAGE_INS = InMemoryLinkState.get_message_ins
FLOWER_STORE_MESSAGE_INS = InMemoryLinkState.store_message_ins
FLOWER_POLLER = vce_api.add_messages_to_queue
"""Flower's own: ours calls its store; the test compares ours with its lookup and poller."""


def install(version: str = flwr.__version__) -> bool:
    """Index the in-memory link state's instructions by node (``True``), or leave Flower's
    methods on another Flower version (``False``). Idempotent."""
    if version != FLOWER_VERSION:
        log.info("Flower %s: the per-node message index is written for Flower %s and is not used; "
                 "with many simulated clients a round costs more (docs/results/performance.md)",
                 version, FLOWER_VERSION)
        return False
    InMemoryLinkState.store_message_ins = store_message_ins
    InMemoryLinkState.get_message_ins = get_message_ins
    vce_api.add_messages_to_queue = add_messages_to_queue
    return True


def _waiting(state: InMemoryLinkState) -> dict[int, dict[str, None]]:
    """The state's index, built from its store the first time (a state made before ``install``)."""
    index = state.__dict__.get(_INDEX)
    if index is None:
        with state.lock:
            index = state.__dict__.get(_INDEX)
            if index is None:
                index = {}
                for message_id, message in state.message_ins_store.items():
                    index.setdefault(message.metadata.dst_node_id, {})[message_id] = None
                setattr(state, _INDEX, index)
    return index


def store_message_ins(self: InMemoryLinkState, message) -> str | None:
    """Flower's ``store_message_ins``, and the stored message's id added to its node's entry."""
    with self.lock:
        message_id = FLOWER_STORE_MESSAGE_INS(self, message)
        if message_id is not None:
            _waiting(self).setdefault(message.metadata.dst_node_id, {})[message_id] = None
    return message_id


def get_message_ins(self: InMemoryLinkState, node_id: int, limit: int | None, *,
                    run_id: int | None = None) -> list:
    """Flower 1.42's ``get_message_ins`` over the node's own messages: the same checks (expiry
    and federation through ``_check_stored_messages``, destination, run, not yet delivered),
    in the same order, the same limit, and the same delivery stamp."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    index = _waiting(self)
    if node_id not in index:  # nothing waits for it
        return []
    message_ins_list = []
    with self.lock:
        waiting = index.get(node_id, {})
        for msg_id in list(waiting):
            self._check_stored_messages({msg_id})
            msg_ins = self.message_ins_store.get(msg_id)
            if msg_ins is None:  # deleted by Flower (replied and pulled, expired, or its run stopped)
                del waiting[msg_id]
            elif (msg_ins.metadata.dst_node_id == node_id
                  and (run_id is None or msg_ins.metadata.run_id == run_id)
                  and msg_ins.metadata.delivered_at == ""):
                message_ins_list.append(msg_ins)
            if limit and len(message_ins_list) == limit:
                break
        if not waiting:
            index.pop(node_id, None)
    delivered_at = in_memory_linkstate.now().isoformat()  # Flower's clock, as Flower's method
    for msg_ins in message_ins_list:
        msg_ins.metadata.delivered_at = delivered_at
    return message_ins_list


def add_messages_to_queue(state: InMemoryLinkState, queue, nodes_mapping: dict[int, int], f_stop) -> None:
    """Flower 1.42's poller (``vce_api.add_messages_to_queue``): every 0.1 s, each node's next
    instruction onto the engine's queue, asking only the nodes with one waiting, in the
    order Flower asks them (``nodes_mapping``'s, the registration order)."""
    while not f_stop.is_set():
        index = _waiting(state)
        for node_id in sorted((n for n in list(index) if n in nodes_mapping), key=nodes_mapping.__getitem__):
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
        f_stop.wait(0.1)
