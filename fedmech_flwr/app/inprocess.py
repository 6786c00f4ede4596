"""Run the ServerApp logic against the ClientApp in one process, without Ray.

A Grid that calls the ClientApp directly: a whole small experiment runs in seconds,
which is what the end-to-end tests and quick debugging need. It wraps the one Flower
internal this needs (``TaskIdentity``, which ``Message`` reads when built outside a
real run, through ``fedmech_flwr.contracts.testing``). The real path is ``flwr run``; this one only
skips the transport.

Like Flower's Grid, a ClientApp exception becomes an error reply, and a reply that
takes longer than ``send_and_receive``'s timeout never arrives (clients run one after
another here, so each call's own duration is compared, as if they ran in parallel).
``train_replies`` (``fedmech_flwr.contracts.testing``, also importable from here) builds mocked
clients' replies for a strategy's tests the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run as FlowerRun  # the project's own Run is fedmech_flwr.app.run.Run

from fedmech_flwr.app.experiment_run import resume_config, run_experiment
from fedmech_flwr.contracts.testing import FIRST_CLIENT_NODE_ID, server_identity
from fedmech_flwr.contracts.testing import train_replies  # noqa: F401  (its old home: tests import it from here)
from fedmech_flwr.spec.config import ExperimentConfig

log = logging.getLogger(__name__)


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls with per-node Contexts: node i's
    node-config is ``node_configs[i]`` (default: partition-id i of ``num_nodes``)."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1,
                 node_configs: list[dict[str, Any]] | None = None) -> None:
        self.client_app = client_app
        self._run = FlowerRun.create_empty(run_id)
        node_configs = node_configs or [{"partition-id": i, "num-partitions": num_nodes} for i in range(num_nodes)]
        self.contexts = {
            FIRST_CLIENT_NODE_ID + i: Context(
                run_id=run_id,
                node_id=FIRST_CLIENT_NODE_ID + i,
                node_config=dict(node_configs[i]),
                state=RecordDict(),
                run_config={},
            )
            for i in range(len(node_configs))
        }
        server_identity(run_id)

    def set_run(self, run: FlowerRun) -> None:
        self._run = run

    @property
    def run(self) -> FlowerRun:
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
            started = time.monotonic()
            try:
                reply = self.client_app(msg, context)
            except Exception as err:  # a client exception becomes an error reply, as in Flower
                reason = f"{type(err).__name__}: {err}"
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
            if timeout is not None and time.monotonic() - started > timeout:
                log.warning("node %d replied after the %gs timeout: reply dropped", msg.metadata.dst_node_id, timeout)
                continue
            replies.append(reply)
        return replies


def run_in_process(cfg: ExperimentConfig, out: str | Path, client_app: ClientApp | None = None,
                   node_configs: list[dict[str, Any]] | None = None) -> Path:
    """Run ``cfg`` with its ClientApp in this process; return the run folder. ``node_configs``:
    one node-config per node (e.g. ``{"data-path": ...}``), default partition-ids."""
    return run_experiment(_grid(cfg, client_app, node_configs), cfg, out=str(out))


def resume_in_process(run_dir: str | Path, client_app: ClientApp | None = None) -> Path:
    """Resume the killed run in ``run_dir`` (its own config) in this process."""
    cfg = resume_config(run_dir)
    return run_experiment(_grid(cfg, client_app), cfg, run_dir=str(run_dir), resume=True)


def _grid(cfg: ExperimentConfig, client_app: ClientApp | None,
          node_configs: list[dict[str, Any]] | None = None) -> InProcessGrid:
    from fedmech_flwr.app.client_app import app as default_client_app

    return InProcessGrid(client_app or default_client_app, cfg.federation.num_clients, node_configs=node_configs)
