"""Contract checks for plug-ins, as scikit-learn's ``check_estimator`` is for estimators.

``check_model``, ``check_client``, ``check_strategy`` and ``check_diagnostic`` run a
registered plug-in on a tiny model and synthetic data (a second or so on a CPU) and raise
one AssertionError naming the plug-in, the rule it breaks and what to fix. The project's
tests run them on every built-in plug-in, and the tests ``fedmech new`` writes on the new
one: one copy of each contract.

The client, strategy and diagnostic checks play a round as the run does: the strategy's
train message (its config and extra arrays) reaches the client it pairs with, the
client's reply (its metrics, uploads and ``client_side`` results) reaches the strategy,
and a strategy's client queries (``query_nodes``) are answered by the registered handlers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from torch import nn

from fedmech_flwr.contracts.client import CLIENTS, ClientData
from fedmech_flwr.contracts.hooks import (
    DIAGNOSTICS,
    ClientContext,
    ClientUpdate,
    GlobalContext,
    Resumable,
    RoundState,
    encode_results,
)
from fedmech_flwr.contracts.outputs import record_key
from fedmech_flwr.contracts.strategy import CLIENT_QUERIES, STRATEGIES, QueryContext, StartsFromItsOwnModel, StrategyContext
from fedmech_flwr.contracts.testing import FIRST_CLIENT_NODE_ID, server_identity, train_replies
from fedmech_flwr.contracts.wire import REPORT_KEY, UPLOAD_PREFIX
from fedmech_flwr.foundation.typed import parse_dataclass
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, pack, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import MODELS, FedMechModel, build_model

NUM_CLASSES, IMAGE_SIZE, SAMPLES, CLIENTS_IN_ROUND = 3, 8, 12, 3
"""The federation the client, strategy and diagnostic checks play: 3 clients of 12 1x8x8
images of 3 classes (4 each), and the 3-class SimpleCNN [4, 8] on them."""
DEVICE = torch.device("cpu")


def _load_builtins() -> None:
    """Register the built-in plug-ins (the plain client, a client's partner strategy)."""
    from fedmech_flwr.contracts import plugins

    plugins.load()


def _fail(kind: str, name: str, rule: str, fix: str) -> NoReturn:
    raise AssertionError(f"{kind} '{name}' {rule}: {fix}")


def _params(registry: Any, name: str, params: Any) -> Any:
    """The entry's validated config: ``params`` as given, or a mapping (None: defaults)."""
    entry = registry.get(name)
    return params if isinstance(params, entry.config_cls) else parse_dataclass(entry.config_cls, params, name)


def _same(a: NamedArrays, b: NamedArrays) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def _copy(arrays: NamedArrays) -> NamedArrays:
    return {k: v.copy() for k, v in arrays.items()}


def _results(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without durations (keys ending in ``seconds``), which no seed fixes."""
    return {k: _results(v) if isinstance(v, dict) else v for k, v in metrics.items() if not k.endswith("seconds")}


def _like(kind: str, name: str, what: str, got: NamedArrays, want: NamedArrays) -> None:
    """``got`` has ``want``'s names (in order), shapes and dtypes, and finite values."""
    for key in want:
        if key not in got:
            _fail(kind, name, f"returned {what} without '{key}'", "return every array of the global model, by name")
        if got[key].shape != want[key].shape or got[key].dtype != want[key].dtype:
            _fail(kind, name, f"returned {what} '{key}' of shape {got[key].shape} and dtype {got[key].dtype}, not "
                  f"{want[key].shape} and {want[key].dtype}", "keep each array's shape and dtype (cast back)")
        if got[key].dtype.kind == "f" and not np.isfinite(got[key]).all():
            _fail(kind, name, f"returned {what} '{key}' with NaN or inf", "return finite values")
    if list(got) != list(want):
        _fail(kind, name, f"returned {what} named {list(got)}, not {list(want)}",
              "return the global model's arrays, no more, in state_dict order")


# --- models --------------------------------------------------------------------------------

def check_model(name: str, params: Any = None, *, in_channels: int = 3, image_size: int = 32,
                num_classes: int = 5, seed: int = 0) -> None:
    """Check that registered model ``name`` honours the ``FedMechModel`` contract the
    diagnostics, pruning and the strategies rely on.

    On a batch of 4 random images: the logits are ``[4, num_classes]`` and finite, and
    every parameter gets a gradient; ``forward_features`` gives ``[4, feature_dim]``,
    ``forward_head`` of those gives the forward's logits (and, with ``pre_logits``, the
    features unchanged), and the classifier is an ``nn.Linear`` reading ``feature_dim``
    features, named ``head``; there are gated layers, the head not among them, each with its
    own gate point whose output has the declared channels (after and before the norm);
    ``permutation_groups``, where the model has them, cover every gated channel array once
    with matching shapes; two builds from ``seed`` hold the same state (names and values)
    and give the same logits.

    Parameters
    ----------
    name : str
        The model's registered name (``MODELS``).
    params : dataclass, mapping or None
        Its config (None: the defaults).
    in_channels, image_size, num_classes : int
        The inputs' shape and the classes the model is built for.
    seed : int
        Seeds both builds (the process-wide generator is restored afterwards).

    Returns
    -------
    None
        When every rule holds; the first rule broken raises.

    Raises
    ------
    AssertionError
        Naming the model, the rule it breaks and what to fix.

    Examples
    --------
    >>> from fedmech_flwr.api.model import check_model
    >>> check_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, image_size=28)
    """
    kind = "model"

    def build() -> FedMechModel:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return build_model(name, _params(MODELS, name, params), in_channels=in_channels,
                               num_classes=num_classes, image_size=image_size)

    model, again = build(), build()
    x = torch.randn(4, in_channels, image_size, image_size, generator=torch.Generator().manual_seed(seed))
    logits = model(x)
    if logits.shape != (4, num_classes) or model.num_classes != num_classes:
        _fail(kind, name, f"gave logits of shape {tuple(logits.shape)} (num_classes {model.num_classes}) for 4 "
              f"images and {num_classes} classes", f"return [batch, num_classes] logits; set num_classes")
    if not torch.isfinite(logits).all():
        _fail(kind, name, "gave NaN or inf logits", "check the initialisation and the layers' shapes")
    F.cross_entropy(logits, torch.arange(4) % num_classes).backward()
    for key, p in model.named_parameters():
        if p.grad is None or not p.grad.abs().sum() > 0:
            _fail(kind, name, f"gives parameter '{key}' no gradient", "use every parameter in the forward pass")

    features = model.forward_features(x)
    if features.shape != (4, model.feature_dim):
        _fail(kind, name, f"gave features of shape {tuple(features.shape)}, not [4, feature_dim={model.feature_dim}]",
              "return pooled [batch, feature_dim] features from forward_features")
    if not torch.equal(model.forward_head(features, pre_logits=True), features):
        _fail(kind, name, "changed the features in forward_head(pre_logits=True)", "return them unchanged")
    if not torch.allclose(model.forward_head(features), logits.detach(), atol=1e-5):
        _fail(kind, name, "gives other logits than forward_head(forward_features(x))",
              "compute the forward as the head of the features, and the head from the features alone")
    head = model.get_classifier()
    if not isinstance(head, nn.Linear) or head.in_features != model.feature_dim or head is not model.head:
        _fail(kind, name, "has no nn.Linear head reading feature_dim features", "make self.head that classifier")
    if "head.weight" not in model.prunable_parameters() or model.head_parameter_names() != {"head.weight",
                                                                                           "head.bias"}:
        _fail(kind, name, "names its head's parameters otherwise than head.weight and head.bias",
              "register the classifier as self.head, an nn.Linear with a bias")

    gated = model.gated_layers()
    if not gated:
        _fail(kind, name, "has no gated layers", "name its conv and linear layers but the head in self._gates")
    if any(model.layer_module(n, before_norm=True) is head for n in gated):
        _fail(kind, name, "gates its head", "leave the head out of self._gates")
    if len({id(model.layer_module(n)) for n in gated}) != len(gated):
        _fail(kind, name, "has gated layers sharing a gate point", "give each gate its own module in self._gates")
    for before_norm in (False, True):
        seen: dict[str, int] = {}
        hooks = [model.layer_module(n, before_norm=before_norm).register_forward_hook(
            lambda m, i, out, n=n: seen.__setitem__(n, out.shape[1])) for n in gated]
        model(x)
        for hook in hooks:
            hook.remove()
        if seen != gated:
            _fail(kind, name, f"has gate points whose outputs hold {seen} channels, not the declared {gated} "
                  f"(before_norm={before_norm})", "point self._gates at the layers the forward pass runs")
    try:
        groups = model.permutation_groups()
    except NotImplementedError:
        groups = None
    if groups is not None:
        state = model.state_dict()
        if sorted(k for g in groups for k in g.rows) != sorted(k for n in gated for k in model.channel_arrays(n)):
            _fail(kind, name, "has permutation groups that do not cover every gated channel array once",
                  "list each gated layer's channel_arrays in exactly one ChannelGroup's rows")
        for g in groups:
            if any(state[k].shape[0] != g.size for k in g.rows) or \
                    any(state[k].shape[1] != g.size * block for k, block in g.columns):
                _fail(kind, name, f"has permutation group '{g.name}' whose arrays do not have {g.size} channels",
                      "give the group's rows and columns their layers' channel counts")

    if list(again.state_dict()) != list(model.state_dict()):
        _fail(kind, name, "names its state differently in two builds", "build the same modules in the same order")
    model.zero_grad()
    if not _same(model_arrays(again), model_arrays(build())) or not torch.equal(again(x), build()(x)):
        _fail(kind, name, f"differs between two builds from seed {seed}",
              "draw every random choice from torch's generator (no other source of randomness)")


# --- a tiny federation ------------------------------------------------------------------------

def _tiny_model() -> FedMechModel:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=NUM_CLASSES,
                           image_size=IMAGE_SIZE)


def _build(arrays: NamedArrays) -> FedMechModel:
    model = _tiny_model()
    load_model_arrays(model, arrays)
    return model.eval()


def _shard(partition_id: int) -> ClientData:
    """Client ``partition_id``'s images: every class, 4 times."""
    generator = torch.Generator().manual_seed(1 + partition_id)
    x = torch.randn(SAMPLES, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return ClientData(x, torch.arange(SAMPLES) % NUM_CLASSES, NUM_CLASSES)


def _context(seed: int) -> StrategyContext:
    return StrategyContext(num_classes=NUM_CLASSES, num_rounds=1, seed=seed, round_timeout_s=60.0,
                           initial=model_arrays(_tiny_model()), build_model=_build, audit=_audit(),
                           num_clients=CLIENTS_IN_ROUND)


def _audit() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8 * NUM_CLASSES, 1, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(99))
    return x, torch.arange(8 * NUM_CLASSES) % NUM_CLASSES


class _Grid(Grid):
    """The checks' nodes (1000, 1001, ...), answering a strategy's client queries with the
    registered handlers on their shards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._run = Run.create_empty(1)
        server_identity()

    @property
    def run(self) -> Run:
        return self._run

    def set_run(self, run: Run) -> None:
        self._run = run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return [FIRST_CLIENT_NODE_ID + i for i in range(CLIENTS_IN_ROUND)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            partition_id = msg.metadata.dst_node_id - FIRST_CLIENT_NODE_ID
            data = _shard(partition_id)
            handler = CLIENT_QUERIES.get(msg.metadata.message_type.partition(".")[2]).factory
            ctx = QueryContext(1, partition_id, _build(from_record(msg.content["arrays"])), msg.content["config"],
                               data.x, data.y, NUM_CLASSES, DEVICE, self.seed, SAMPLES)
            replies.append(Message(handler(ctx), reply_to=msg))
        return replies


def _client(name: str, params: Any, partition_id: int, seed: int, received: dict[str, NamedArrays]):
    model = _tiny_model()
    return CLIENTS.get(name).factory(
        _params(CLIENTS, name, params), model=model, data=_shard(partition_id),
        train=TrainConfig(optimizer="sgd", lr=0.05, epochs=1, batch_size=4), pruning=PruningConfig(mode="dense"),
        seed=seed, partition_id=partition_id, state={}, received=received)


def _sent(strategy: Any, initial: NamedArrays, seed: int) -> list[Message]:
    """The strategy's round-1 train messages to the nodes."""
    return list(strategy.configure_train(1, to_record(initial), ConfigRecord(), _Grid(seed)))


def _received(msg: Message) -> tuple[dict[str, Any], dict[str, NamedArrays]]:
    """A train message's config (with the round) and extra arrays, as the ClientApp reads them."""
    received = {k: from_record(v) for k, v in msg.content.array_records.items() if k != "arrays"}
    return {**msg.content["config"], "server-round": 1}, received


def _partner(entry: Any, seed: int) -> Any:
    """The strategy a client pairs with, built with its defaults; None for any."""
    if not entry.pairs_with:
        return None
    partner = STRATEGIES.get(entry.pairs_with[0])
    return partner.factory(partner.config_cls(), _context(seed))


# --- clients -------------------------------------------------------------------------------

def check_client(name: str, params: Any = None, *, seed: int = 0) -> None:
    """Check that registered client ``name`` trains one round as the ClientApp needs.

    Its ``fit``, on a 12-image shard of a 3-class SimpleCNN with the config and arrays the
    strategy it pairs with sends (``pairs_with``; the plain train config otherwise),
    returns one finite array per entry of the model's state, of its shape and dtype, and a
    number of examples between 1 and the shard's size; it leaves the arrays it was given as
    they were; and a second client from the same seed returns the same arrays.

    Parameters
    ----------
    name : str
        The client's registered name (``CLIENTS``).
    params : dataclass, mapping or None
        Its config (None: the defaults).
    seed : int
        The experiment's seed the clients get.

    Returns
    -------
    None
        When every rule holds; the first rule broken raises.

    Raises
    ------
    AssertionError
        Naming the client, the rule it breaks and what to fix.

    Examples
    --------
    >>> from fedmech_flwr.api.client import check_client
    >>> check_client("proximal")
    """
    _load_builtins()
    kind, entry = "client", CLIENTS.get(name)
    initial = model_arrays(_tiny_model())
    config, received = {"server-round": 1}, {}
    if (partner := _partner(entry, seed)) is not None:
        config, received = _received(_sent(partner, initial, seed)[0])

    def fit() -> tuple[NamedArrays, int, NamedArrays]:
        client = _client(name, params, 0, seed, copy.deepcopy(received))
        given = [v.copy() for v in initial.values()]
        weights, num_examples, _ = client.fit(given, dict(config))
        if len(weights) != len(initial):
            _fail(kind, name, f"returned {len(weights)} arrays for a model of {len(initial)}",
                  "return get_parameters(): every state_dict entry, in order")
        return dict(zip(initial, (np.asarray(w).copy() for w in weights))), num_examples, dict(zip(initial, given))

    weights, num_examples, given = fit()
    _like(kind, name, "weights", weights, initial)
    if not _same(given, initial):
        _fail(kind, name, "changed the arrays fit was given", "copy them before changing them")
    if not isinstance(num_examples, (int, np.integer)) or not 0 < num_examples <= SAMPLES:
        _fail(kind, name, f"reported {num_examples!r} examples for a shard of {SAMPLES}",
              "return the number of examples trained on (an int)")
    if not _same(fit()[0], weights):
        _fail(kind, name, f"returned other weights in a second fit from seed {seed}",
              "draw every random choice from seed_for(seed, ...) or the generator fit is given")


# --- strategies ----------------------------------------------------------------------------

def _round(name: str, params: Any, seed: int, diagnostics: Sequence[str]) -> tuple[Any, NamedArrays, NamedArrays]:
    """One round of strategy ``name``: (the strategy, the model sent, the aggregate)."""
    entry = STRATEGIES.get(name)
    ctx = _context(seed)
    strategy = entry.factory(_params(STRATEGIES, name, params), ctx)
    initial = ctx.initial
    if isinstance(strategy, StartsFromItsOwnModel):
        initial = strategy.initial_model(initial)
    client = entry.pairs_with[0] if entry.pairs_with else "plain"
    models, counts, metrics, reports = [], [], [], []
    for i, msg in enumerate(_sent(strategy, initial, seed)):
        config, received = _received(msg)
        trained = _client(client, None, i, seed, received)
        weights, num_examples, client_metrics = trained.fit([v.copy() for v in initial.values()], config)
        ctx = ClientContext(1, i, _build(initial), trained.model.eval(), trained.data.x, trained.data.y, NUM_CLASSES,
                            DEVICE, seed)
        results = {d: DIAGNOSTICS.get(d).factory(DIAGNOSTICS.get(d).config_cls()).client_side(ctx) for d in diagnostics}
        models.append(dict(zip(initial, weights)))
        counts.append(num_examples)
        metrics.append({k: v for k, v in client_metrics.items() if isinstance(v, (int, float))})
        reports.append({"partition-id": i, "details": "{}", **encode_results(results),
                        **{UPLOAD_PREFIX + k: pack(v) for k, v in trained.upload.items()}})
    replies = train_replies(models, counts)
    for reply, sent, report in zip(replies, metrics, reports):
        reply.content["metrics"].update(sent)
        reply.content[REPORT_KEY] = ConfigRecord(report)
    sent_copy, before = _copy(initial), [from_record(r.content["arrays"]) for r in replies]
    arrays, _ = strategy.aggregate_train(1, replies)
    if arrays is None:
        _fail("strategy", name, "aggregated good replies into None", "return the aggregate's ArrayRecord")
    if not _same(initial, sent_copy) or not all(_same(from_record(r.content["arrays"]), b)
                                                for r, b in zip(replies, before)):
        _fail("strategy", name, "changed the arrays of the replies or of the model it sent",
              "copy them before changing them")
    return strategy, initial, from_record(arrays)


def check_strategy(name: str, params: Any = None, *, diagnostics: Sequence[str] = (), seed: int = 0) -> None:
    """Check that registered strategy ``name`` aggregates one round as the run needs.

    Three clients (the client it pairs with, else ``plain``) train on 12-image shards from
    its train messages; their replies (weights, metrics, uploads, as the ClientApp sends
    them: ``train_replies``) aggregate into arrays with the model's names, shapes and
    dtypes, finite; the replies' arrays and the model sent stay as they were; a second
    strategy from the same seed aggregates the same arrays; and a ``Resumable`` one's
    ``state_arrays``, loaded into a fresh one, come back unchanged.

    Parameters
    ----------
    name : str
        The strategy's registered name (``STRATEGIES``).
    params : dataclass, mapping or None
        Its config (None: the defaults).
    diagnostics : sequence of str
        Diagnostics whose ``client_side`` results (with their default config) the
        clients send, for a strategy that reads them (``circuit_masked_avg``: circuits).
    seed : int
        The experiment's seed (``StrategyContext.seed``).

    Returns
    -------
    None
        When every rule holds; the first rule broken raises.

    Raises
    ------
    AssertionError
        Naming the strategy, the rule it breaks and what to fix.

    Examples
    --------
    >>> from fedmech_flwr.api.strategy import check_strategy
    >>> check_strategy("fedavg", {"weighting": "uniform"})
    """
    _load_builtins()
    kind = "strategy"
    strategy, initial, aggregate = _round(name, params, seed, diagnostics)
    _like(kind, name, "aggregate", aggregate, initial)
    if not _same(_round(name, params, seed, diagnostics)[2], aggregate):
        _fail(kind, name, f"aggregated the same replies otherwise in a second run from seed {seed}",
              "draw every random choice from seed_for(ctx.seed, ...)")
    if isinstance(strategy, Resumable):
        state = _copy(strategy.state_arrays())
        fresh = STRATEGIES.get(name).factory(_params(STRATEGIES, name, params), _context(seed))
        fresh.load_state_arrays(_copy(state))
        if not _same(_copy(fresh.state_arrays()), state):
            _fail(kind, name, "gives other state_arrays after load_state_arrays of its own",
                  "restore in load_state_arrays everything state_arrays saves")


# --- diagnostics ---------------------------------------------------------------------------

def _round_state(name: str, diagnostic: Any, seed: int) -> RoundState:
    """Round 1 of the plain clients: their updates with ``diagnostic``'s client-side
    results, the test and audit sets (and the pooled shards where it asks for them)."""
    initial = model_arrays(_tiny_model())
    updates = {}
    for i in range(CLIENTS_IN_ROUND):
        client = _client("plain", None, i, seed, {})
        weights, num_examples, _ = client.fit([v.copy() for v in initial.values()], {"server-round": 1})
        arrays = dict(zip(initial, (np.asarray(w).copy() for w in weights)))
        data = client.data
        local = ClientContext(1, i, _build(initial), _build(arrays), data.x, data.y, NUM_CLASSES, DEVICE, seed)
        updates[i] = ClientUpdate(i, arrays, num_examples, {}, _result(name, diagnostic.client_side(local)))
    global_arrays = {k: np.mean([u.arrays[k] for u in updates.values()], axis=0).astype(v.dtype)
                     for k, v in initial.items()}
    for i, update in updates.items():
        data = _shard(i)
        ctx = GlobalContext(1, i, _build(global_arrays), data.x, data.y, NUM_CLASSES, DEVICE, seed)
        update.global_diagnostics = _result(name, diagnostic.client_side_global(ctx))
    test = _shard(CLIENTS_IN_ROUND)
    datasets = {"test": (test.x, test.y), "audit": _audit()}
    if diagnostic.needs_pooled_data():
        shards = [_shard(i) for i in updates]
        datasets["pooled"] = (torch.cat([s.x for s in shards]), torch.cat([s.y for s in shards]))
    return RoundState(1, global_arrays, initial, updates, datasets, NUM_CLASSES, _build, DEVICE, seed)


def _result(name: str, result: dict[str, Any] | None) -> dict[str, Any]:
    """A client-side result as ``ClientUpdate`` holds it: by the diagnostic's name, where it has one."""
    return {} if result is None else {name: result}


def check_diagnostic(name: str, params: Any = None, *, seed: int = 0) -> None:
    """Check that registered diagnostic ``name`` observes a round as the run needs.

    On round 1 of three clients of a 3-class SimpleCNN (with its own ``client_side`` and
    ``client_side_global`` results, the test and audit sets, and the pooled shards where
    ``needs_pooled_data`` says so), ``server_side`` returns a ``DiagnosticResult`` holding
    every metric its registered ``Outputs`` declare, each a finite number or None
    (undefined); it leaves every model it is given as it was (the global, previous and
    clients' arrays); and a second diagnostic from the same
    seed returns the same metrics and arrays.

    Parameters
    ----------
    name : str
        The diagnostic's registered name (``DIAGNOSTICS``).
    params : dataclass, mapping or None
        Its config (None: the defaults).
    seed : int
        The experiment's seed (``RoundState.seed``).

    Returns
    -------
    None
        When every rule holds; the first rule broken raises.

    Raises
    ------
    AssertionError
        Naming the diagnostic, the rule it breaks and what to fix.

    Examples
    --------
    >>> from fedmech_flwr.api.diagnostic import check_diagnostic
    >>> check_diagnostic("weight_divergence")
    """
    _load_builtins()
    kind, entry = "diagnostic", DIAGNOSTICS.get(name)

    def run() -> tuple[Any, RoundState, list[NamedArrays]]:
        diagnostic = entry.factory(_params(DIAGNOSTICS, name, params))
        state = _round_state(name, diagnostic, seed)
        models = [state.global_arrays, state.previous_global_arrays, *(u.arrays for u in state.clients.values())]
        before = [_copy(m) for m in models]
        result = diagnostic.server_side(state)
        if not all(_same(m, b) for m, b in zip(models, before)):
            _fail(kind, name, "changed a model it was given", "copy arrays before changing them; only observe")
        return result, state, models

    result, _, _ = run()
    if not hasattr(result, "metrics") or not isinstance(result.metrics, dict):
        _fail(kind, name, f"returned {type(result).__name__} from server_side", "return a DiagnosticResult")
    record = {record_key(k): v for k, v in result.metrics.items()}
    declared = entry.outputs.metrics if entry.outputs else {}
    if declared and not any(m.path[0] in record for m in declared.values()):
        _fail(kind, name, f"recorded none of the metrics its Outputs declare ({', '.join(declared)})",
              "record them (None where undefined), or declare what it records")
    for key, metric in declared.items():
        value: Any = record
        for step in metric.path:
            if value is None or value is record and step not in record:
                break  # undefined, or not measured with these parameters
            if not isinstance(value, dict) or step not in value:
                _fail(kind, name, f"recorded '{metric.path[0]}' without '{'.'.join(metric.path)}', which its "
                      f"Outputs declare as '{key}'", "record the declared path (None where undefined)")
            value = value[step]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not record and value is not None and not (number and math.isfinite(value)):
            _fail(kind, name, f"recorded {value!r} as '{'.'.join(metric.path)}'",
                  "record a finite number, or None where the metric is undefined")
    again, _, _ = run()
    if _results(again.metrics) != _results(result.metrics) or list(again.arrays) != list(result.arrays) or \
            not all(np.array_equal(again.arrays[k], v) for k, v in result.arrays.items()):
        _fail(kind, name, f"returned other results in a second run from seed {seed}",
              "draw every random choice from seed_for(state.seed, ...)")

