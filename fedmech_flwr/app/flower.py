"""The diagnostics in your own Flower app: a small, stable API.

A Flower app of your own (your model, your ClientApp and training loop, a stock Flower
strategy such as FedAvgM or FedAdam) gets this project's diagnostics without moving into
its layout:

- on the server, ``WithDiagnostics(strategy, model_builder, config, test=..., audit=...)``
  wraps any Flower strategy of the Message API, the way Flower's DP wrappers do. Its
  ``start`` is Flower's, and runs ``fedmech run``'s own run lifecycle
  (``fedmech_flwr.app.run.Run``): every round, after the strategy aggregated, the new
  global model is evaluated on ``test`` and the due diagnostics run on it (their
  client-side parts through this project's ``query.diagnose``); the run folder is the
  one ``fedmech run`` writes (config, with your strategy and its arguments, environment,
  partitions, metrics.jsonl, checkpoints, the final model and plots, status), and the
  ServerApp's log shows the same round lines;
- on every client, ``attach_diagnostics(app, model_builder, train_data)`` registers the
  queries that server sends (``query.identify``, ``query.diagnose``) on your ClientApp and
  adds the diagnostics' after-training part (``Diagnostic.client_side``, e.g. local
  circuits) to its train replies.

What your app must do:

- ``model_builder()`` returns a fresh ``fedmech_flwr.models.FedMechModel`` (the same
  architecture on the server and every client; an ordinary module through
  ``fedmech_flwr.models.wrap_module``): diagnostics read features, the head and the gated
  layers through that contract, never through the model's class;
- every SuperNode's node-config holds ``partition-id`` and ``num-partitions`` (simulation
  sets them; ``flower-supernode --node-config`` on real devices), ``num-partitions`` equal
  to ``federation.num_clients``;
- train replies hold one ArrayRecord (the model's ``state_dict`` names) and a MetricRecord
  with ``num-examples``, as Flower's FedAvg family needs anyway;
- ``train_data(context)`` returns the node's training images and labels (tensors).

Not offered here: ``fedmech run --resume`` of such a run, nodes with their own data
(``data-path``) and server-side re-pruning.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedmech_flwr.app.client_app import node_partition
from fedmech_flwr.app.client_side import NodeRound
from fedmech_flwr.app.protocol import RoundProtocol
from fedmech_flwr.app.run import LabelledSet, Run, RunInputs, output_root, show_logs
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.wire import CONFIG_KEY, DIAGNOSE_ACTION, IDENTIFY_ACTION, REPORT_KEY
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays
from fedmech_flwr.learning.training import resolve_device
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.spec.config import FlowerAppConfig, parse_flower_app, plugin_registries, read_yaml

__all__ = ["WithDiagnostics", "attach_diagnostics"]

ModelBuilder = Callable[[], torch.nn.Module]
"""The server's: a fresh model (a ``FedMechModel``), the architecture the clients train."""
NodeModelBuilder = Callable[[Context], torch.nn.Module]
"""A client's: the same fresh model, given the node's Flower context (a ClientApp learns its
run config only from it)."""
TrainData = Callable[[Context], LabelledSet]
"""The node's own training data, given its Flower context."""


def _fedmech_model(model: torch.nn.Module, where: str) -> FedMechModel:
    """``model`` if it keeps the FedMechModel contract, else a TypeError saying so."""
    if not isinstance(model, FedMechModel):
        raise TypeError(
            f"{where} returned a {type(model).__name__}, but the diagnostics need a "
            "fedmech_flwr.models.FedMechModel: they read its features, head and gated layers (the "
            "layers circuits put gates on) through that contract. Build the model as a FedMechModel "
            "subclass, take a registered one (fedmech_flwr.models.build_model), or wrap yours with "
            "fedmech_flwr.models.wrap_module, on the server and the clients alike"
        )
    return model


def _holding(model: torch.nn.Module, arrays: NamedArrays, device: torch.device) -> FedMechModel:
    """A fresh ``model`` holding ``arrays``, on ``device``, in eval mode."""
    model = _fedmech_model(model, "model_builder")
    load_model_arrays(model, arrays)
    return model.to(device).eval()


class WithDiagnostics(Strategy):
    """Any Flower strategy, with this project's diagnostics after every aggregation.

    Parameters
    ----------
    strategy : Strategy
        A Flower strategy of the Message API (``flwr.serverapp.strategy``). It samples as it
        likes among the clients the round protocol offers (all of them unless
        ``federation.clients_per_round`` says otherwise) and aggregates as it likes.
    model_builder : callable
        ``model_builder()``: a fresh ``FedMechModel``, the architecture the clients train.
    config : mapping, FlowerAppConfig, or a YAML file's path
        ``FlowerAppConfig``'s keys: ``name``, ``seed``, ``federation`` (``num_clients`` is
        required in practice: the SuperNodes to wait for), ``diagnostics`` (a list written as
        in an experiment, e.g. ``[{name: circuits, every: 1}]``), ``output_root``, ``device``,
        ``tensorboard``.
        ``num_classes`` comes from the model.
    test : (images, labels)
        The server's test set: the global model's eval record every round, and the
        diagnostics' ``test`` data set.
    audit : (images, labels), optional
        The server's audit set, held out from every client, with the same number of images
        of each class; what ``misalignment`` trains probes and heads on, and what
        ``circuits`` (``audit: true``) and ``usae`` use. Diagnostics that need it refuse to
        start without it.
    out : str or Path, optional
        The output root (else ``FEDMECH_OUT``, else ``output_root``); absolute, since the
        ServerApp runs in the SuperLink's working directory.
    """

    def __init__(self, strategy: Strategy, model_builder: ModelBuilder,
                 config: Mapping[str, Any] | FlowerAppConfig | str | Path, *, test: LabelledSet,
                 audit: LabelledSet | None = None, out: str | Path | None = None) -> None:
        plugins.load()
        model = _fedmech_model(model_builder(), "model_builder()")
        self.strategy = strategy
        self.model_builder = model_builder
        self.cfg = _app_config(config, model.num_classes)
        self.test = test
        self.audit = audit
        self.out = str(out) if out else None
        self._check()
        self._run: Run | None = None

    def _check(self) -> None:
        """Each diagnostic's own rules (as ``fedmech validate`` runs them), against the sets given."""
        n = self.cfg.num_classes
        per_class = 0
        if self.audit is not None:
            counts = torch.bincount(self.audit[1].cpu(), minlength=n).tolist()
            if len(set(counts)) != 1:
                raise ValueError(f"audit must hold the same number of images of every class (probes and heads "
                                 f"split it per class), got {counts} images of classes 0..{n - 1}")
            per_class = counts[0]
        shape = tuple(self.test[0].shape[1:])
        info = DataInfo(torch.zeros(0, dtype=torch.long), len(self.test[1]), n, shape, per_class)
        registry = plugin_registries()["diagnostic"]
        for i, spec in enumerate(self.cfg.diagnostics):
            if spec.build().needs_pooled_data():
                raise ConfigError(f"diagnostic '{spec.name}' trains on every client's data pooled, which a server "
                                  "of your own Flower app does not hold (only `fedmech run`'s simulation does); "
                                  "turn that option off", f"WithDiagnostics config: diagnostics[{i}]")
            if (check := registry.get(spec.name).check) is None:
                continue
            try:
                check(spec.params, self.cfg, info, f"WithDiagnostics config: diagnostics[{i}]")
            except ConfigError as err:
                if self.audit is None and "audit" in err.message:
                    raise ConfigError(f"diagnostic '{spec.name}' needs the server's audit set, but WithDiagnostics was "
                                      "given none: pass audit=(images, labels), the same number of each class, held "
                                      "out from every client", err.where) from None
                raise

    def summary(self) -> None:
        (self._run.protocol if self._run and self._run.protocol else self.strategy).summary()

    @property
    def run_dir(self) -> Path | None:
        """The run folder, once ``start`` made it."""
        return self._run.folder.path if self._run and self._run.folder else None

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``, writing a run folder (``run_dir``) as it goes.

        The run is ``fedmech run``'s (``fedmech_flwr.app.run.Run``): before the first round
        every node is asked its partition-id and label histogram (``query.identify``); each
        round ends with your ``evaluate_fn`` (if any), then the server's evaluation on
        ``test``, the divergence check, the diagnostics, the checkpoint and the console's
        round line. Returns Flower's ``Result``.
        """
        show_logs()
        cfg = self.cfg = replace(self.cfg, federation=replace(self.cfg.federation, num_rounds=num_rounds,
                                                               round_timeout_s=float(timeout)))
        device = resolve_device(cfg.device)
        datasets = {"test": tuple(t.to(device) for t in self.test)}
        if self.audit is not None:
            datasets["audit"] = tuple(t.to(device) for t in self.audit)
        self._run = Run(RunInputs(
            cfg, {**cfg.to_plain(), "strategy": strategy_record(self.strategy)}, self.strategy,
            partial(self._build, device=device), device, cfg.num_classes,
            [f"class {c}" for c in range(cfg.num_classes)], datasets, ConfigRecord({CONFIG_KEY: cfg.to_json()}),
            output_root(cfg, self.out),
        ))
        return self._run.execute(grid, from_record(initial_arrays), train_config=train_config,
                                 evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def _build(self, arrays: NamedArrays, device: torch.device) -> FedMechModel:
        return _holding(self.model_builder(), arrays, device)

    def _started(self) -> RoundProtocol:
        if self._run is None or self._run.protocol is None:
            raise RuntimeError("WithDiagnostics runs through its start(grid, initial_arrays, ...); call that")
        return self._run.protocol

    # Flower's steps: the round protocol's, around the wrapped strategy.
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._started().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self._started().aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._started().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self._started().aggregate_evaluate(server_round, replies)


def strategy_record(strategy: Strategy) -> dict[str, Any]:
    """What config.yaml records of a Flower strategy: its class and its settings (the
    plain values among its public attributes, as its constructor stored them)."""
    kind = type(strategy)
    settings = {k: v for k, v in vars(strategy).items()
                if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
    return {"name": f"{kind.__module__}.{kind.__qualname__}", **settings}


def _app_config(config: Mapping[str, Any] | FlowerAppConfig | str | Path, num_classes: int) -> FlowerAppConfig:
    """``config`` validated, with the model's class count."""
    if isinstance(config, FlowerAppConfig):
        return replace(config, num_classes=num_classes)
    if isinstance(config, (str, Path)):
        raw, source = read_yaml(config), str(config)
    else:
        raw, source = dict(config), "WithDiagnostics config"
    if "num_classes" in raw:
        raise ConfigError("num_classes comes from the model (model_builder().num_classes); leave it out",
                          f"{source}: num_classes")
    return parse_flower_app({**raw, "num_classes": num_classes}, source)


# --- the client side ------------------------------------------------------------------------

_SETTINGS: dict[str, FlowerAppConfig] = {}


def _settings(text: str) -> FlowerAppConfig:
    """The server's settings, parsed once per process."""
    if text not in _SETTINGS:
        plugins.load()
        _SETTINGS[text] = parse_flower_app(json.loads(text), "config from the ServerApp")
    return _SETTINGS[text]


_PARTITION_NEEDED = ("the diagnostics need each SuperNode's partition-id and num-partitions; start it with "
                     "--node-config 'partition-id=I num-partitions=N'")


@dataclass(frozen=True)
class _Node:
    """What the handlers ``attach_diagnostics`` registers need of the user's app."""

    model_builder: NodeModelBuilder
    train_data: TrainData

    def data(self, context: Context, device: torch.device) -> LabelledSet:
        x, y = self.train_data(context)
        return x.to(device), y.to(device)

    def model(self, context: Context, arrays: ArrayRecord, device: torch.device) -> FedMechModel:
        return _holding(self.model_builder(context), from_record(arrays), device)

    def round(self, context: Context, config: ConfigRecord) -> NodeRound:
        """This node's round, for the server's settings in ``config``."""
        cfg = _settings(str(config[CONFIG_KEY]))
        device = resolve_device(cfg.device)
        partition_id, _ = node_partition(context, _PARTITION_NEEDED)
        x, y = self.data(context, device)
        server_round = int(config["server-round"])
        return NodeRound(cfg.diagnostics, server_round, partition_id, x, y, cfg.num_classes, device, cfg.seed)


def attach_diagnostics(app: ClientApp, model_builder: NodeModelBuilder, train_data: TrainData) -> ClientApp:
    """Give your ClientApp the client side of ``WithDiagnostics``; returns ``app``.

    ``model_builder(context)`` returns a fresh ``FedMechModel`` (the server's architecture),
    ``train_data(context)`` the node's training images and labels.

    Registers ``query.identify`` (this node's partition-id and label histogram) and
    ``query.diagnose`` (``client_side_global`` on the new aggregate), and wraps the train
    functions already registered (call it after ``@app.train()``) so that their replies
    carry this node's partition-id and the due diagnostics' ``client_side`` results on the
    model received and the model trained. A train message from a server without
    ``WithDiagnostics`` is answered by your function alone.
    """
    funcs = app._registered_funcs  # Flower has no public way to wrap a registered function
    trains = [name for name in funcs if name.startswith(f"{MessageType.TRAIN}.")]
    if not trains:
        raise RuntimeError("attach_diagnostics(app, ...) found no train function on app: call it after your "
                           "@app.train() function is defined")
    node = _Node(model_builder, train_data)
    for name in trains:
        funcs[name] = partial(_train_then_diagnose, funcs[name], node)
    app.query(IDENTIFY_ACTION)(partial(_identify, node))
    app.query(DIAGNOSE_ACTION)(partial(_diagnose, node))
    return app


def _identify(node: _Node, msg: Message, context: Context) -> Message:
    cfg = _settings(str(msg.content["config"][CONFIG_KEY]))
    partition_id, total = node_partition(context, _PARTITION_NEEDED)
    _, y = node.train_data(context)
    hist = torch.bincount(y.cpu(), minlength=cfg.num_classes).tolist()
    info = MetricRecord({"partition-id": partition_id, "num-partitions": total, "num-samples": len(y),
                         "label-histogram": hist})
    return Message(RecordDict({"node": info}), reply_to=msg)


def _train_then_diagnose(train: Callable[[Message, Context], Message], node: _Node, msg: Message,
                         context: Context) -> Message:
    reply = train(msg, context)
    config = next((c for c in msg.content.config_records.values() if CONFIG_KEY in c), None)
    if reply.has_error() or config is None:
        return reply
    here = node.round(context, config)
    (sent,), (trained,) = msg.content.array_records.values(), reply.content.array_records.values()
    reply.content[REPORT_KEY] = here.train_report(node.model(context, sent, here.device),
                                                  node.model(context, trained, here.device), {})
    return reply


def _diagnose(node: _Node, msg: Message, context: Context) -> Message:
    here = node.round(context, msg.content["config"])
    return here.diagnose_reply(msg, node.model(context, msg.content["arrays"], here.device))
