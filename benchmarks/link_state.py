"""One pass of Flower's simulation engine over the federation's nodes, three ways, side
by side on the same link state: Flower's own poller and lookup
(``vce_api.add_messages_to_queue``, ``InMemoryLinkState.get_message_ins``), Flower's poller
with the per-node index as the lookup, and both of ``fedmech_flwr.app.link_index``.

Flower 1.42's simulation engine asks every node for its next instruction ten times a
second. Here the link state is built by Flower's own functions (the run, then
``_register_nodes``), a round's 10 train instructions are stored for 10 nodes, and one
pass is timed; the messages it delivered are stamped back as undelivered after it, so
every pass sees the same store.

    python benchmarks/link_state.py [--nodes 100 10000 100000] [--messages 10] [--passes 5]

Prints the median pass per node count, each way, and Flower's over both of ours.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from queue import Queue

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build(num_nodes: int, num_messages: int):
    """A simulation's link state with ``num_nodes`` nodes and ``num_messages`` waiting."""
    from test_link_index import message, simulation_state

    state, nodes = simulation_state(num_nodes)
    step = max(1, num_nodes // num_messages)
    for number, node in enumerate(nodes[::step][:num_messages]):
        state.store_message_ins(message(number, node, created_at=time.time()))
    return state, nodes


def one_pass(poller, lookup, state, nodes) -> float:
    """Seconds for one pass of ``poller`` over the nodes with ``lookup`` as the link state's
    ``get_message_ins``; the messages it queued are put back as undelivered."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from test_link_index import OnePass

    InMemoryLinkState.get_message_ins = lookup
    queue, mapping = Queue(), {node: i for i, node in enumerate(nodes)}
    start = time.perf_counter()
    poller(state, queue, mapping, OnePass())
    took = time.perf_counter() - start
    while not queue.empty():
        queue.get_nowait().metadata.delivered_at = ""
    return took


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 10_000, 100_000])
    parser.add_argument("--messages", type=int, default=10, help="instructions waiting (a round's sampled clients)")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args(argv)

    from flwr.supercore.task_identity import TaskIdentity

    from fedmech_flwr.app import link_index

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # as a ServerApp's process
    link_index.install()  # the index is kept as messages are stored
    ways = {"Flower": (link_index.FLOWER_POLLER, link_index.FLOWER_GET_MESSAGE_INS),
            "index": (link_index.FLOWER_POLLER, link_index.get_message_ins),
            "index+poller": (link_index.add_messages_to_queue, link_index.get_message_ins)}
    print(f"{'nodes':>7} " + " ".join(f"{name + ' ms':>15}" for name in ways) + f" {'Flower / both':>14}", flush=True)
    for n in args.nodes:
        state, nodes = build(n, args.messages)
        ms = {name: 1e3 * statistics.median(one_pass(*way, state, nodes) for _ in range(args.passes))
              for name, way in ways.items()}
        print(f"{n:>7} " + " ".join(f"{v:>15.3f}" for v in ms.values()) +
              f" {ms['Flower'] / ms['index+poller']:>14.1f}", flush=True)
    link_index.install()


if __name__ == "__main__":
    main()
