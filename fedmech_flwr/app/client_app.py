"""The Flower ClientApp: a thin Message-API adapter around the experiment's NumPyClient.

Flower's current strategies speak the Message API, the user's clients are NumPyClients.
A node trains on one of two kinds of data, chosen by its ``--node-config``:

- ``partition-id=I num-partitions=N``: shard I of the experiment's dataset, rebuilt from
  the whole dataset, the seed and I (the simulation, and nodes that hold the dataset);
- ``data-path=PATH`` (and optionally ``node-name=NAME``): its own data, an .npz or an image
  folder tree (``node_data``), checked against the experiment when the server first asks
  who the node is, before any round; bad data is refused there with the reason.

For each train message this adapter builds the client's data, converts the global
``ArrayRecord`` to a NumPy list in ``state_dict`` order, calls the client's ``fit``, runs
the due client-side diagnostics, and replies with:

- ``arrays``: the trained weights (ArrayRecord, same names as the global model);
- ``metrics``: ``num-examples`` and the client's numeric metrics (MetricRecord; the
  strategy averages these);
- ``report``: ``partition-id`` (the client's partition id: a shard node's partition-id, or
  the id the server gave an own-data node), ``details`` (a JSON string with per-client values that
  must not be averaged: per-class accuracy, per-layer sparsity; ``ray-node``, the Ray
  node the client trained on, in Flower's simulation), the client-side
  diagnostic results (see ``hooks.encode_results``), the arrays the client uploads for its
  strategy (``upload:<name>``) and its state (``client-state``), packed.

A client's state (``FedMechClient.state``) is kept in the node's ``context.state`` between
rounds; a train message that carries a ``client-state`` ArrayRecord (a resumed run's first
message to the node) replaces it. Other ArrayRecords of a train message are the
strategy's (``FedMechClient.received``).

``query.diagnose`` messages (sent by the run's round end after aggregation) carry the new
aggregate; the ClientApp runs the due diagnostics' ``client_side_global`` on it with the
client's data and replies with a ``report``.

Any other ``query.<name>`` is a strategy's client query: it carries a model, and the
ClientApp replies with the record of the handler registered under ``name`` in
``fedmech_flwr.contracts.strategy.CLIENT_QUERIES``, run on the client's own data.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedmech_flwr.app.client_side import NodeRound
from fedmech_flwr.app.node_data import NodeData, NodeDataError, NodeDataSpec, load_node_data
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.client import CLIENTS, ClientData
from fedmech_flwr.contracts.strategy import CLIENT_QUERIES, QueryContext
from fedmech_flwr.contracts.wire import (
    CLIENT_STATE_KEY,
    CONFIG_KEY,
    DATA_SPEC_KEY,
    DIAGNOSE_ACTION,
    IDENTIFY_ACTION,
    PARTITION_IDS_KEY,
    REPORT_KEY,
    UPLOAD_PREFIX,
)
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays, pack, to_record
from fedmech_flwr.learning.training import evaluate, resolve_device
from fedmech_flwr.spec.config import Component, ExperimentConfig, experiment_from_json
from fedmech_flwr.spec.experiment import client_partitions, load_data, new_model

log = logging.getLogger(__name__)

_CORE_QUERIES = (IDENTIFY_ACTION, DIAGNOSE_ACTION)
"""The query actions the core answers itself."""


class _ClientApp(ClientApp):
    """Flower's ClientApp, which also answers strategies' client queries.

    Flower dispatches by exact message type, so ``query.<name>`` for any name not in
    ``_CORE_QUERIES`` goes to ``client_query``, which looks the name up when the message
    arrives: queries registered after import (plug-ins load lazily; tests register their
    own) are served, and an unknown name is refused naming the registered ones."""

    def __call__(self, message: Message, context: Context) -> Message:
        category, _, action = message.metadata.message_type.partition(".")
        if category == MessageType.QUERY and action not in _CORE_QUERIES:
            return client_query(message, context)
        return super().__call__(message, context)


app = _ClientApp()

DATA_PATH = "data-path"
"""node-config key: the node's own data (an .npz or an image folder tree)."""
NODE_NAME = "node-name"
"""node-config key: the stable name an own-data node is known by (default: its node id)."""

_CONFIGS: dict[str, ExperimentConfig] = {}
_NODE_DATA: dict[tuple[str, str], NodeData] = {}


def _config(text: str) -> ExperimentConfig:
    """Parse the ServerApp's config once per process (it is the same every round),
    importing its plug-ins (``plugins:``) as the server did."""
    if text not in _CONFIGS:
        plugins.load()
        _CONFIGS[text] = experiment_from_json(text)
    return _CONFIGS[text]


def node_experiment(config: ConfigRecord, context: Context) -> ExperimentConfig:
    """The experiment the server sent, parsed here. A node that cannot parse it (it lacks
    one of the experiment's plug-ins, say) refuses to take part: a ConfigError naming the
    node, also logged on the node's console."""
    try:
        return _config(str(config[CONFIG_KEY]))
    except ConfigError as err:
        log.error("node '%s' refuses to take part: %s", node_key(context), err)
        raise ConfigError(f"node '{node_key(context)}': {err}") from None


SHARD_OR_OWN_DATA = ("this SuperNode has neither partition-id/num-partitions nor data-path; start it with "
                     "--node-config 'partition-id=I num-partitions=N' (a shard of the experiment's dataset) "
                     "or --node-config 'data-path=PATH' (its own data)")


def node_partition(context: Context, missing: str = SHARD_OR_OWN_DATA) -> tuple[int, int]:
    """The node's ``(partition-id, num-partitions)``; a RuntimeError saying ``missing``
    (how to start the node) when its node-config lacks them."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as err:
        raise RuntimeError(missing) from err


def node_key(context: Context) -> str:
    """The name an own-data node is sampled and recorded by: ``node-name`` from its
    node-config, else its node id (under SuperNode auth, tied to its registered key)."""
    return str(context.node_config.get(NODE_NAME) or f"node-{context.node_id}")


def own_data(context: Context, spec_json: str) -> NodeData | None:
    """This node's own data checked against the experiment (read once per process), or
    None for a shard node. Bad data is refused with a ``NodeDataError`` that names the
    node, and logged on the node's console."""
    if DATA_PATH not in context.node_config:
        return None
    if "partition-id" in context.node_config:
        raise ConfigError(f"node '{node_key(context)}' has both data-path and partition-id in its node-config; "
                          "give data-path (its own data) or partition-id/num-partitions (a shard), not both")
    key = (str(context.node_config[DATA_PATH]), spec_json)
    if key not in _NODE_DATA:
        try:
            _NODE_DATA[key] = load_node_data(key[0], NodeDataSpec.from_json(spec_json))
        except NodeDataError as err:
            log.error("node '%s' refuses to take part: %s", node_key(context), err)
            raise NodeDataError(f"node '{node_key(context)}': {err}") from None
    return _NODE_DATA[key]


def _partition_id(config: ConfigRecord, context: Context) -> int:
    """The partition id the server gave this own-data node when it joined
    (``PARTITION_IDS_KEY``)."""
    ids = json.loads(str(config[PARTITION_IDS_KEY]))
    if str(context.node_id) not in ids:
        raise RuntimeError(f"the server gave node '{node_key(context)}' (node id {context.node_id}) no partition "
                           "id: it was refused before the first round (see the run's failure records)")
    return int(ids[str(context.node_id)])


def node_dataset(cfg: ExperimentConfig, node_config: dict[str, Any]) -> ExperimentConfig:
    """``cfg`` with ``data.dataset.root`` replaced by the node's ``data-root``, if it has one.

    A real device keeps its copy of the dataset where it likes and says so with
    ``flower-supernode --node-config "partition-id=I num-partitions=N data-root=/path"``;
    every node must hold the same dataset (each derives its shard from the whole).
    """
    if "data-root" not in node_config:
        return cfg
    dataset = cfg.data.dataset
    if not any(f.name == "root" for f in dataclasses.fields(dataset.params)):
        raise ConfigError(
            f"this node's node-config sets data-root={node_config['data-root']!r}, but dataset "
            f"'{dataset.name}' has no root to replace; drop data-root from --node-config"
        )
    params = dataclasses.replace(dataset.params, root=str(node_config["data-root"]))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=Component(dataset.name, params)))


def _decode(value: Any) -> Any:
    """NumPyClient metrics are scalars; ours carry lists and dicts as JSON strings."""
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def ray_node() -> dict[str, str]:
    """The id of the Ray node this ClientApp runs on, when it runs in a Ray actor (Flower's
    simulation); empty elsewhere. Every client record of a simulation carries it
    (``ray_node``): which node of a Ray cluster trained what. It never changes a weight."""
    ray = sys.modules.get("ray")  # a SuperNode's ClientApp never imports it: not in Ray
    if ray is None or not ray.is_initialized():
        return {}
    return {"ray-node": ray.get_runtime_context().get_node_id()}


def _setup(msg: Message, context: Context):
    """The config, round, partition id, device, data and a fresh model for ``msg``."""
    config = msg.content["config"]
    cfg = node_dataset(_config(str(config[CONFIG_KEY])), context.node_config)
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    device = resolve_device(cfg.device)
    server_round = int(config["server-round"])
    if own := own_data(context, str(config.get(DATA_SPEC_KEY, ""))):
        spec = NodeDataSpec.from_json(str(config[DATA_SPEC_KEY]))
        val = (own.x_val.to(device), own.y_val.to(device)) if own.x_val is not None else (None, None)
        data = ClientData(own.x.to(device), own.y.to(device), own.num_classes, *val)
        return cfg, server_round, _partition_id(config, context), device, data, new_model(cfg, spec, device)
    partition_id, total = node_partition(context)
    if total != cfg.federation.num_clients:
        raise RuntimeError(f"num-partitions={total} but federation.num_clients={cfg.federation.num_clients}")
    bundle = load_data(cfg)
    idx = torch.from_numpy(client_partitions(cfg, bundle)[partition_id])
    data = ClientData(bundle.x_train[idx].to(device), bundle.y_train[idx].to(device), bundle.num_classes)
    return cfg, server_round, partition_id, device, data, new_model(cfg, bundle, device)


@app.query(IDENTIFY_ACTION)
def identify(msg: Message, context: Context) -> Message:
    """Tell the server who this node is: the partition it holds, or, for a node with its
    own data, its key and that data's label histogram and sample count (nothing more
    about the data leaves the node), once the data passed the experiment's checks and its
    plug-ins were imported here."""
    node_experiment(msg.content["config"], context)
    if own := own_data(context, str(msg.content["config"][DATA_SPEC_KEY])):
        info = MetricRecord({"num-samples": len(own.y), "label-histogram": own.label_histogram})
        return Message(RecordDict({"node": info, "name": ConfigRecord({"node-key": node_key(context)})}), reply_to=msg)
    partition_id, total = node_partition(context)
    info = MetricRecord({"partition-id": partition_id, "num-partitions": total})
    return Message(RecordDict({"node": info}), reply_to=msg)


def _client_state(msg: Message, context: Context) -> NamedArrays:
    """The client's state: the copy a resumed run's server sent, else what this node kept
    from the client's last round (empty at first)."""
    for holder in (msg.content, context.state):
        if CLIENT_STATE_KEY in holder.array_records:
            return from_record(holder.array_records[CLIENT_STATE_KEY])
    return {}


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, server_round, partition_id, device, data, model = _setup(msg, context)
    received = {name: from_record(record) for name, record in msg.content.array_records.items()
                if name not in ("arrays", CLIENT_STATE_KEY)}
    client = CLIENTS.get(cfg.client.name).factory(
        cfg.client.params, model=model, data=data, train=cfg.train, pruning=cfg.pruning,
        seed=cfg.seed, partition_id=partition_id, state=_client_state(msg, context), received=received,
    )
    global_arrays = from_record(msg.content["arrays"])
    weights = {k: global_arrays[k] for k in model.state_dict()}
    global_model = copy.deepcopy(model)  # the diagnostics' global model; ``fit`` loads the client's, once
    load_model_arrays(global_model, weights)
    fit_config = {k: v for k, v in msg.content["config"].items() if k != CONFIG_KEY}
    new_params, num_examples, client_metrics = client.fit(list(weights.values()),
                                                          {**fit_config, "server-round": server_round})

    numeric = {k: v for k, v in client_metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    details = {k: _decode(v) for k, v in client_metrics.items() if k not in numeric} | ray_node()
    if data.x_val is not None:  # a node's own validation split: its numbers are the node's alone, never averaged
        val = evaluate(model, data.x_val, data.y_val, data.num_classes, cfg.eval_batch_size)
        details.update({"val-loss": val.loss, "val-accuracy": val.accuracy})
    node = NodeRound(cfg.diagnostics, server_round, partition_id, data.x, data.y, data.num_classes, device, cfg.seed)
    report = node.train_report(global_model.eval(), model.eval(), details)
    for name, arrays in client.upload.items():
        report[UPLOAD_PREFIX + name] = pack(arrays)
    if client.state:
        context.state[CLIENT_STATE_KEY] = to_record(client.state)
        report[CLIENT_STATE_KEY] = pack(client.state)
    content = RecordDict({
        "arrays": to_record(dict(zip(model.state_dict(), new_params))),
        "metrics": MetricRecord({"num-examples": int(num_examples), **numeric}),
        REPORT_KEY: report,
    })
    return Message(content, reply_to=msg)


@app.query(DIAGNOSE_ACTION)
def diagnose(msg: Message, context: Context) -> Message:
    cfg, server_round, partition_id, device, data, model = _setup(msg, context)
    load_model_arrays(model, from_record(msg.content["arrays"]))
    node = NodeRound(cfg.diagnostics, server_round, partition_id, data.x, data.y, data.num_classes, device, cfg.seed)
    return node.diagnose_reply(msg, model.eval())


def client_query(msg: Message, context: Context) -> Message:
    """Answer a strategy's ``query.<name>`` with its registered handler's record."""
    plugins.load()
    handler = CLIENT_QUERIES.get(msg.metadata.message_type.partition(".")[2]).factory
    cfg, server_round, partition_id, device, data, model = _setup(msg, context)
    load_model_arrays(model, from_record(msg.content["arrays"]))
    ctx = QueryContext(server_round, partition_id, model.eval(), msg.content["config"], data.x, data.y,
                       data.num_classes, device, cfg.seed, cfg.eval_batch_size)
    return Message(handler(ctx), reply_to=msg)
