"""The round protocol that wraps any Flower strategy (the way Flower's DP wrappers do).

``RoundProtocol`` adds, around whatever strategy the experiment names:

- node discovery (``discover_nodes``): every node is a client with a stable partition id:
  its node-config's partition-id (a shard node) or, for a node with its own data, one of
  the ids left over, given in the order of the nodes' keys (``node-name``, else the node
  id); a node whose data fails the experiment's checks is refused before the first
  round. In Flower's simulation, where every node is a shard node, ``simulated_roster``
  reads the same map from the simulation engine without a message;
- sampling by partition id with a seeded RNG (Flower samples node IDs, which are random
  per run); the inner strategy is offered only the sampled nodes and trains all of them;
- aggregation in partition-id order (bitwise-reproducible sums);
- the failed-client policy (``fail`` the run, or ``continue`` with at least N replies),
  always written to the per-round log; a client fails when it raises, does not reply
  within ``round_timeout_s``, sends NaN/Inf weights (dropped before aggregation, so
  the global model is never poisoned) or is lost with its Ray node (``ray_actors``: the
  record names the node);
- the mask policy after aggregation (optional server-side re-pruning);
- the per-client record of every round (FedAvg only keeps averaged metrics), and the
  round's book-keeping (``RoundSummary``: who was sampled and succeeded, the model sent
  and the updates received) that the run's round end (``fedmech_flwr.app.run``) reads;
- the server's copy of each client's own state (``FedMechClient.state``, kept on the node
  between rounds): the state of its last accepted reply, saved with every resume point. A
  node keeps the state its client computed even when the reply is then dropped (NaN
  weights, a timeout), so the client's next train message carries the accepted copy
  (empty when none was accepted) and node and server agree again (SCAFFOLD's c_i and c,
  FedDyn's h_k and h);
- resuming a killed run: Flower's ``Strategy.start`` always counts rounds from 1, so a
  run resumed after round r runs the remaining rounds with every round number shifted
  by r (``resume_after``); a client's first train message after the resume carries its
  saved state back to its node.

So every strategy, built-in or user-written, gets the same protocol.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.superlink.grid import InMemoryGrid

from fedmech_flwr.app.ray_actors import lost_node
from fedmech_flwr.artifacts.folder import RunFolder
from fedmech_flwr.contracts.hooks import ClientUpdate, decode_results
from fedmech_flwr.contracts.wire import CLIENT_STATE_KEY, IDENTIFY_ACTION, REPORT_KEY
from fedmech_flwr.foundation.errors import raised_where_in_text
from fedmech_flwr.foundation.safe_text import strip_colours
from fedmech_flwr.foundation.seeds import numpy_rng, seed_for, seeded_globals
from fedmech_flwr.learning.arrays import NamedArrays, from_record, non_finite, to_record, unpack
from fedmech_flwr.spec.config import ExperimentConfig, FlowerAppConfig

log = logging.getLogger(__name__)

SHARD, NODE_PROVIDED = "shard", "node-provided"
"""Where a client's data comes from (``NodeInfo.source``, partitions.json ``source``)."""


RAISED_CODES = (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.CLIENT_APP_CRASHED, ErrorCode.LOAD_CLIENT_APP_EXCEPTION)
"""Flower error codes of a ClientApp that raised or crashed (reason ``raised: ...``)."""
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:\([\w.]+\))?: \S")
"""A traceback's ``module.Type: message`` line (unindented, a dotted name, then ``: ``)."""
FLOWER_REASON = re.compile(r"^<class '([^']+)'>:<'(.*)'>$", re.DOTALL)
"""How Flower's simulation wraps a ClientApp exception: ``<class 'T'>:<'str(exception)'>``."""
WRAPPER_EXCEPTIONS = ("ClientAppException", "RayTaskError")
"""Exceptions that only wrap a client's own error; their lines are passed over."""
REASON_MAX_CHARS = 200


def one_line(text: str) -> str:
    """A client's error text as one line for a record: without colour codes, and of a
    traceback (Ray forwards a whole one, chained causes included) only the first
    exception line that is not one of Flower's or Ray's wrappers, i.e. the client's own
    ``Type: message``; at most ``REASON_MAX_CHARS`` long."""
    text = strip_colours(text).strip()
    kind = ""
    if wrapped := FLOWER_REASON.match(text):
        kind, text = wrapped.group(1).rsplit(".", 1)[-1], wrapped.group(2).strip()
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    raised = [line for line in lines if EXCEPTION_LINE.match(line)
              and not any(w in line.split(":", 1)[0] for w in WRAPPER_EXCEPTIONS)]
    if raised:
        line = raised[0]
    elif kind and lines and not any(w in kind for w in WRAPPER_EXCEPTIONS):
        line = f"{kind}: {lines[-1]}"
    else:
        line = lines[-1] if lines else "(no reason given)"
    return line if len(line) <= REASON_MAX_CHARS else line[: REASON_MAX_CHARS - 3] + "..."


class ClientFailure(RuntimeError):
    """A client failed and the experiment's policy says the run must stop."""


def failure_reason(error: Error) -> str:
    """One line: ``raised: Type: message`` for a ClientApp exception, with the plug-in
    module and file:line that raised it (``raised_where``); Flower's code and reason
    otherwise (of a traceback, its exception line: ``one_line``)."""
    reason = one_line(error.reason)
    if error.code not in RAISED_CODES:
        return f"error {error.code}: {reason}"
    where = raised_where_in_text(strip_colours(error.reason))
    return f"raised: {reason}" + (f" (in {where})" if where else "")


@dataclass(frozen=True)
class NodeInfo:
    """One client of the run: its node and where its data comes from."""

    node_id: int
    source: str
    """``SHARD`` (a partition of the experiment's dataset) or ``NODE_PROVIDED``."""
    name: str = ""
    """An own-data node's key (``node-name``, else ``node-<id>``)."""
    num_samples: int = 0
    label_histogram: tuple[int, ...] = ()
    """What the node reported of its data: an own-data node, or a shard of a user's own
    Flower app (``fedmech_flwr.app.flower``); the server knows its own experiment's shards."""


@dataclass
class Roster:
    """The federation as discovered before the first round."""

    clients: dict[int, NodeInfo]
    """Partition id -> node, ascending."""
    refused: list[tuple[int, str, str]]
    """(node id, one-line reason, the error's whole text) of nodes refused at discovery."""

    @property
    def node_ids(self) -> dict[int, int]:
        """``{partition_id: node_id}``."""
        return {partition_id: info.node_id for partition_id, info in self.clients.items()}

    def ids_json(self) -> str:
        """``{node_id: partition_id}`` of the own-data nodes as JSON, for ``PARTITION_IDS_KEY``
        (a shard node's id is its partition-id, which it knows; leaving shard nodes out
        keeps every message's config from growing with the federation)."""
        return json.dumps({str(info.node_id): partition_id for partition_id, info in self.clients.items()
                           if info.source == NODE_PROVIDED})


def connected_nodes(grid: Grid, expected: int, timeout: float) -> list[int]:
    """The ids of the ``expected`` connected nodes, sorted, once they are all there; a
    ``ClientFailure`` when fewer connect within ``timeout`` or more are connected."""
    deadline = time.monotonic() + timeout
    while len(node_ids := sorted(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise ClientFailure(
                f"only {len(node_ids)} of {expected} SuperNodes connected within {timeout:.0f}s; "
                f"federation.num_clients is {expected}: start that many SuperNodes "
                f"(simulation: --federation-config 'num-supernodes={expected}')"
            )
        time.sleep(1)
    if len(node_ids) > expected:
        raise ClientFailure(
            f"{len(node_ids)} SuperNodes are connected but federation.num_clients is {expected}; "
            f"run with as many SuperNodes as clients (simulation: --federation-config "
            f"'num-supernodes={expected}') or set federation.num_clients={len(node_ids)}"
        )
    return node_ids


def simulated_roster(grid: Grid, expected: int, timeout: float) -> Roster | None:
    """The roster of Flower's simulation, without a message; None on any other Grid.

    Flower's simulation engine registers its nodes one after another and gives the i-th
    the node-config ``partition-id=i num-partitions=N``; its ``InMemoryGrid``'s link state
    lists the nodes in that order. So every node is a shard node whose partition-id is
    known here, and asking each one (``discover_nodes``) would only cost a message per
    node, which Flower's engine delivers in time that grows with nodes x messages (minutes
    at 10,000 nodes). ``RoundProtocol`` checks every train reply's partition-id against
    this map, so a Flower that numbered nodes otherwise would stop the run at round 1.
    """
    if not isinstance(grid, InMemoryGrid):
        return None
    connected = set(connected_nodes(grid, expected, timeout))
    in_order = [info.node_id for info in grid.state.get_node_info() if info.node_id in connected]
    return Roster({partition_id: NodeInfo(node, SHARD) for partition_id, node in enumerate(in_order)}, [])


def discover_nodes(grid: Grid, expected: int, timeout: float, config: ConfigRecord, num_classes: int) -> Roster:
    """Ask every node who it is (``config`` carries the experiment and ``DATA_SPEC_KEY``,
    which own-data nodes check their data against) with ``query.identify``, and give each
    a partition id.

    Waits until ``expected`` nodes are connected. Shard nodes keep their partition-id;
    own-data nodes get the ids no shard node holds, in the order of their keys. A node
    that replies with an error, or reports a histogram that does not fit, is refused
    (``Roster.refused``); a federation that does not match the experiment (wrong node
    count, duplicate partition-ids or names) fails clearly.
    """
    node_ids = connected_nodes(grid, expected, timeout)
    kind = f"{MessageType.QUERY}.{IDENTIFY_ACTION}"
    queries = [Message(RecordDict({"config": config}), dst_node_id=n, message_type=kind) for n in node_ids]
    shards: dict[int, NodeInfo] = {}
    own: dict[str, NodeInfo] = {}
    refused = []
    for reply in sorted(grid.send_and_receive(queries, timeout=timeout), key=lambda r: r.metadata.src_node_id):
        node = reply.metadata.src_node_id
        if reply.has_error():
            refused.append((node, failure_reason(reply.error), reply.error.reason))
            continue
        info = reply.content.metric_records["node"]
        if "partition-id" in info:
            partition_id, total = int(info["partition-id"]), int(info["num-partitions"])
            if total != expected:
                raise ClientFailure(f"node {node} says num-partitions={total}, but federation.num_clients is "
                                    f"{expected}; they must agree")
            if partition_id in shards:
                raise ClientFailure(f"two nodes claim partition-id {partition_id}; each node needs its own")
            if not 0 <= partition_id < expected:
                raise ClientFailure(f"node {node} claims partition-id {partition_id}, outside 0..{expected - 1}")
            reported = tuple(int(c) for c in info.get("label-histogram", []))  # a user's own ClientApp says it
            shards[partition_id] = NodeInfo(node, SHARD, num_samples=int(info.get("num-samples", 0)),
                                            label_histogram=reported)
            continue
        name = str(reply.content.config_records["name"]["node-key"])
        hist = tuple(int(c) for c in info["label-histogram"])
        if name in own:
            raise ClientFailure(f"two nodes are called '{name}'; give each its own node-name in --node-config")
        if len(hist) != num_classes or sum(hist) != int(info["num-samples"]):
            refused.append((node, f"node '{name}' reported a label histogram of {len(hist)} classes summing to "
                                  f"{sum(hist)} for {int(info['num-samples'])} samples; expected {num_classes} classes", ""))
            continue
        own[name] = NodeInfo(node, NODE_PROVIDED, name, int(info["num-samples"]), hist)
    answered = {r[0] for r in refused} | {i.node_id for i in (*shards.values(), *own.values())}
    refused += [(n, f"timeout: no reply within {timeout:g}s", "") for n in node_ids if n not in answered]
    free = [partition_id for partition_id in range(expected) if partition_id not in shards]
    clients = {**shards, **dict(zip(free, (own[name] for name in sorted(own))))}
    return Roster(dict(sorted(clients.items())), sorted(refused))


class _OfferedGrid(Grid):
    """A view of a Grid whose ``get_node_ids`` lists only the nodes sampled this round."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid = grid
        self._node_ids = node_ids

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    # Everything else is the real Grid's.
    def set_run(self, run):
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, *args, **kwargs):
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self._grid.send_and_receive(messages, timeout=timeout)


@dataclass
class RoundSummary:
    """Book-keeping of the current round, read by the run's round end."""

    server_round: int = 0
    sampled: tuple[int, ...] = ()
    succeeded: tuple[int, ...] = ()
    started_at: float = 0.0
    train_seconds: float = 0.0
    """From sending the train messages to having every reply (transport + client work)."""
    sent: NamedArrays = field(default_factory=dict)
    """The global model the clients started this round from."""
    updates: dict[int, ClientUpdate] = field(default_factory=dict)
    """The usable updates, by partition id (ascending)."""


def client_update(reply: Message) -> ClientUpdate:
    """Unpack a train reply (arrays, metrics, report) into a ClientUpdate."""
    content = reply.content
    report = content.config_records[REPORT_KEY]
    details = json.loads(str(report["details"]))
    arrays_record = next(iter(content.array_records.values()))
    metrics = dict(next(iter(content.metric_records.values())))
    return ClientUpdate(
        partition_id=int(report["partition-id"]),
        arrays=from_record(arrays_record),
        num_examples=int(metrics["num-examples"]),
        metrics={**metrics, **details},
        diagnostics=decode_results(report),
        state=unpack(report[CLIENT_STATE_KEY]) if CLIENT_STATE_KEY in report else {},
    )


class RoundProtocol(Strategy):
    """Wrap ``strategy`` with fedmech's round protocol.

    Parameters
    ----------
    strategy : Strategy
        Any Flower strategy. It is offered the sampled nodes; this project's strategies
        train all of them (``fraction_train=1.0``, minimum node counts of 1), a user's own
        may sample among them: the round records the nodes it addressed.
    cfg : ExperimentConfig or FlowerAppConfig
        The resolved experiment, or a user's own Flower app's diagnostics settings
        (sampling, failure policy, seed; sent to the clients with the diagnose query).
    partitions : dict[int, int]
        ``{partition_id: node_id}`` (``Roster.node_ids`` from :func:`discover_nodes`).
    recorder : RunFolder
        Where per-client records, failures and the strategy's metrics are written.
    post_aggregate : callable, optional
        Applied to the aggregated arrays before anything else sees them (mask policy).
    resume_after : int, optional
        The last completed round of a killed run being resumed; None for a new run.
    sent_metrics : callable, optional
        Metrics of the aggregate as sent (after the mask policy), added to the strategy's
        record of the round (the sent model's accuracy, where the strategy reports another).
    """

    def __init__(
        self,
        strategy: Strategy,
        cfg: ExperimentConfig | FlowerAppConfig,
        partitions: dict[int, int],
        recorder: RunFolder,
        post_aggregate: Callable[[NamedArrays], NamedArrays] | None = None,
        resume_after: int | None = None,
        sent_metrics: Callable[[NamedArrays], dict[str, float]] | None = None,
    ) -> None:
        self.strategy = strategy
        self.sent_metrics = sent_metrics
        self.cfg = cfg
        self.partitions = partitions
        self.node_to_partition = {node: partition_id for partition_id, node in partitions.items()}
        self.recorder = recorder
        self.post_aggregate = post_aggregate
        self.resume_after = resume_after
        self.offset = resume_after or 0
        """Added to Flower's round number to get the experiment's round."""
        self.current = RoundSummary()
        self.client_states: dict[int, NamedArrays] = {}
        """Partition id -> the state its last accepted reply carried (empty for a client whose
        replies were all dropped)."""
        self._on_node: set[int] = set()
        """Clients whose node holds their accepted state in this Flower run (their last reply
        in it was accepted)."""
        self._evaluate_hinted = False
        """Whether a failed evaluate reply has been explained (``aggregate_evaluate``)."""

    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round`` (seeded by seed and round; sorted)."""
        fed = self.cfg.federation
        everyone = sorted(self.partitions)
        if fed.clients_per_round is None or fed.clients_per_round >= len(everyone):
            return everyone
        rng = numpy_rng(self.cfg.seed, "client-sampling", None, server_round)
        drawn = rng.choice(everyone, size=fed.clients_per_round, replace=False)
        return sorted(int(partition_id) for partition_id in drawn)

    def summary(self) -> None:
        log.info("RoundProtocol around %s", type(self.strategy).__name__)
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        server_round += self.offset
        sampled = self.sample(server_round)
        self.current = RoundSummary(server_round, tuple(sampled), started_at=time.perf_counter(), sent=from_record(arrays))
        offered = _OfferedGrid(grid, [self.partitions[partition_id] for partition_id in sampled])
        with seeded_globals(seed_for(self.cfg.seed, "flower-sampling", None, server_round)):  # Flower samples with random
            messages = list(self.strategy.configure_train(server_round, arrays, config, offered))
        # a strategy that samples itself (a user's own, fraction_train < 1) trains fewer
        self.current.sampled = tuple(sorted(self.node_to_partition[m.metadata.dst_node_id] for m in messages))
        for msg in messages:
            partition_id = self.node_to_partition[msg.metadata.dst_node_id]
            # a resumed run or a dropped reply
            if partition_id in self.client_states and partition_id not in self._on_node:
                # strategies share one content among their messages: this one gets its own
                msg.content = RecordDict({**msg.content, CLIENT_STATE_KEY: to_record(self.client_states[partition_id])})
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        replies = list(replies)
        self.current.train_seconds = time.perf_counter() - self.current.started_at
        usable, failures = self._screen(replies)
        self._apply_failure_policy(server_round, failures, len(usable))
        # a failed client's node may hold a state the server never accepted: resend the accepted one
        for partition_id, _, _ in failures:
            self._on_node.discard(partition_id)
            self.client_states.setdefault(partition_id, {})
        updates = self.current.updates = {u.partition_id: u for _, u in usable}
        self.current.succeeded = tuple(updates)
        for update in updates.values():
            self.recorder.client(server_round, update)
            self._on_node.add(update.partition_id)
            if update.state:
                self.client_states[update.partition_id] = update.state
        arrays, metrics = self.strategy.aggregate_train(server_round, [reply for reply, _ in usable])
        if arrays is None:
            raise ClientFailure(f"round {server_round}: {type(self.strategy).__name__} returned no aggregated model")
        if self.post_aggregate is not None:
            arrays = to_record(self.post_aggregate(from_record(arrays)))
        if self.sent_metrics is not None and (extra := self.sent_metrics(from_record(arrays))):
            metrics = MetricRecord({**(metrics or {}), **extra})
        if metrics:
            self.recorder.strategy(server_round, dict(metrics))
        return arrays, metrics

    def _screen(self, replies: list[Message]) -> tuple[list[tuple[Message, ClientUpdate]], list[tuple[int, str, str]]]:
        """Usable replies (partition-id order) and failed clients with a one-line reason
        and the error's whole text (empty but for error replies): an error reply, no reply
        before the timeout, or NaN/Inf in the returned weights. A reply from a client other
        than the one its node was sampled as (the roster is wrong) stops the run."""
        partition_of = {id(r): self.node_to_partition[r.metadata.src_node_id] for r in replies}
        timeout = self.cfg.federation.round_timeout_s
        failures = [(partition_id, f"timeout: no reply within {timeout:g}s", "")
                    for partition_id in self.current.sampled if partition_id not in partition_of.values()]
        usable = []
        for reply in sorted(replies, key=lambda r: partition_of[id(r)]):
            if reply.has_error():
                failures.append((partition_of[id(reply)], failure_reason(reply.error), reply.error.reason))
                continue
            update = client_update(reply)
            if update.partition_id != partition_of[id(reply)]:
                raise ClientFailure(
                    f"node {reply.metadata.src_node_id} was sampled as client {partition_of[id(reply)]} but replied as "
                    f"client {update.partition_id}: the roster does not match the federation's partition-ids"
                )
            if bad := non_finite(update.arrays):
                failures.append((update.partition_id, f"non-finite weights in {', '.join(bad)}", ""))
                continue
            usable.append((reply, update))
        return usable, sorted(failures)

    def _apply_failure_policy(self, server_round: int, failures: list[tuple[int, str, str]], num_usable: int) -> None:
        fed = self.cfg.federation
        for partition_id, reason, details in failures:
            self.recorder.failure(server_round, partition_id, reason, fed.on_client_failure, details,
                                  ray_node=lost_node(reason))
            log.warning("round %d: client %d failed: %s", server_round, partition_id, reason)
        if failures and fed.on_client_failure == "fail":
            partition_id, reason, _ = failures[0]
            raise ClientFailure(
                f"round {server_round}: client {partition_id} failed ({reason}); "
                "federation.on_client_failure is 'fail' (set it to 'continue' to drop failed clients)"
            )
        if num_usable < fed.min_replies:
            raise ClientFailure(
                f"round {server_round}: only {num_usable} successful replies, federation.min_replies is {fed.min_replies}"
            )

    def state_arrays(self) -> NamedArrays:
        """The clients' states for the resume point, as ``<partition id>/<name>``."""
        return {f"{partition_id}/{k}": v
                for partition_id, state in sorted(self.client_states.items()) for k, v in state.items()}

    def load_state_arrays(self, arrays: NamedArrays) -> None:
        self.client_states = {}
        for key, value in arrays.items():
            partition_id, name = key.split("/", 1)
            self.client_states.setdefault(int(partition_id), {})[name] = value

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        offered = _OfferedGrid(grid, [self.partitions[partition_id] for partition_id in self.current.sampled])
        return self.strategy.configure_evaluate(server_round + self.offset, arrays, config, offered)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The strategy's own evaluation of the clients' replies; the first round in which
        some ClientApp answered with an error says once what to do (a ClientApp without
        ``@app.evaluate()`` answers every evaluate message so)."""
        replies = list(replies)
        failed = [r for r in replies if r.has_error()]
        if failed and not self._evaluate_hinted:
            self._evaluate_hinted = True
            log.warning("round %d: %d of %d clients answered the strategy's evaluate message with an error (%s); "
                        "the strategy sends one every round (Flower's fraction_evaluate): give your ClientApp an "
                        "@app.evaluate() function, or the strategy fraction_evaluate=0.0",
                        server_round + self.offset, len(failed), len(replies), failure_reason(failed[0].error))
        return self.strategy.aggregate_evaluate(server_round + self.offset, replies)
