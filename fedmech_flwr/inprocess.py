"""Run the ServerApp logic against the ClientApp in one process, without Ray.

A Grid that calls the ClientApp directly: a whole small experiment runs in seconds,
which is what the end-to-end tests and quick debugging need. It wraps the one Flower
internal this needs (``TaskIdentity``, which ``Message`` reads when built outside a
real run). The real path is ``flwr run``; this one only skips the transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.server import run_experiment

SERVER_NODE_ID = 1
_FIRST_CLIENT_NODE_ID = 1000


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls with per-node Contexts (partition-id i)."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1) -> None:
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self.contexts = {
            _FIRST_CLIENT_NODE_ID + i: Context(
                run_id=run_id,
                node_id=_FIRST_CLIENT_NODE_ID + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 1

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            context = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.client_app(msg, context)
            except Exception as err:  # a client exception becomes an error reply, as in Flower
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            replies.append(reply)
        return replies


def run_in_process(cfg: ExperimentConfig, out: str | Path, client_app: ClientApp | None = None) -> Path:
    """Run ``cfg`` with its ClientApp in this process; return the run folder."""
    from fedmech_flwr.client_app import app as default_client_app

    grid = InProcessGrid(client_app or default_client_app, cfg.federation.num_clients)
    return run_experiment(grid, cfg, out=str(out))
