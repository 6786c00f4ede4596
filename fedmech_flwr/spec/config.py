"""Typed, validated experiment configuration loaded from YAML.

Every section is a dataclass; unknown keys, wrong types and out-of-range values fail
before anything runs, naming the file, the key, the bad value and what is allowed.
Sections backed by a registry (dataset, partition, model, client, strategy, diagnostics)
are written as ``{name: <registered name>, <param>: <value>, ...}`` and their parameters
are validated into the config dataclass that the plug-in registered. The modules listed
under ``plugins:`` are imported first, so what they register may be chosen there.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.client import CLIENTS
from fedmech_flwr.contracts.hooks import DIAGNOSTICS
from fedmech_flwr.contracts.strategy import STRATEGIES
from fedmech_flwr.datasets.data import DATASETS
from fedmech_flwr.datasets.partition import PARTITIONERS
from fedmech_flwr.foundation.errors import ConfigError, brief, shape
from fedmech_flwr.foundation.registry import Registry
from fedmech_flwr.foundation.safe_text import CONTROL, printable
from fedmech_flwr.foundation.typed import join_key, parse_dataclass, to_plain
from fedmech_flwr.foundation.yaml_text import load_yaml, read_yaml_file
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import MODELS

PLUGIN_KEYS = {
    "dataset": "data.dataset",
    "partition": "data.partition",
    "model": "model",
    "client": "client",
    "strategy": "strategy",
    "diagnostic": "diagnostics",
}
"""Each plug-in kind and the experiment key that chooses it (``diagnostics`` is a list)."""
PARTNERS = {"strategy": "client", "client": "strategy"}
"""Kinds whose entries may name the partners they only work with (``Entry.pairs_with``)."""


def plugin_registries() -> dict[str, Registry]:
    """The registry of each plug-in kind, keyed as ``PLUGIN_KEYS``."""
    return {
        "dataset": DATASETS,
        "partition": PARTITIONERS,
        "model": MODELS,
        "client": CLIENTS,
        "strategy": STRATEGIES,
        "diagnostic": DIAGNOSTICS,
    }


def _registry(kind: str) -> Registry:
    return plugin_registries()[kind]


@dataclass
class Component:
    """A registered plug-in chosen by ``name`` and its validated parameters."""

    name: str
    params: Any

    def to_plain(self) -> dict[str, Any]:
        return {"name": self.name, **to_plain(self.params)}


def _parse_component(kind: str, raw: Any, where: str, extra: tuple[str, ...] = ()) -> tuple[Component, dict]:
    registry = _registry(kind)
    if not isinstance(raw, dict) or "name" not in raw:
        names = ", ".join(registry.names())
        raise ConfigError(f"expected a mapping with a 'name' key (one of: {names}), got {brief(raw)}", where)
    name = raw["name"]
    entry = registry.get(str(name), join_key(where, "name"))
    params = {k: v for k, v in raw.items() if k != "name" and k not in extra}
    taken = {k: raw[k] for k in extra if k in raw}
    return Component(entry.name, parse_dataclass(entry.config_cls, params, where)), taken


def component(kind: str, **kwargs: Any) -> Any:
    """A dataclass field holding a ``Component`` of the registry ``kind``."""
    return field(metadata={"parse": lambda raw, where: _parse_component(kind, raw, where)[0]}, **kwargs)


@dataclass
class DiagnosticSpec:
    """A diagnostic plug-in run after aggregation every ``every`` rounds, or after exactly
    the ``rounds`` listed (a long run measured at a few horizons, e.g. ``[3, 10, 20]``)."""

    name: str
    every: int
    params: Any
    rounds: tuple[int, ...] | None = None

    def due(self, server_round: int) -> bool:
        if self.rounds is not None:
            return server_round in self.rounds
        return server_round % self.every == 0

    def build(self) -> Any:
        """A fresh instance of the registered diagnostic, with these parameters."""
        return _registry("diagnostic").get(self.name).factory(self.params)

    def to_plain(self) -> dict[str, Any]:
        when = {"every": self.every} if self.rounds is None else {"rounds": list(self.rounds)}
        return {"name": self.name, **when, **to_plain(self.params)}


def _parse_diagnostics(raw: Any, where: str) -> list[DiagnosticSpec]:
    if not isinstance(raw, list):
        raise ConfigError(f"expected a list of diagnostics, got {brief(raw)}", where)
    specs = []
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        comp, taken = _parse_component("diagnostic", item, here, extra=("every", "rounds"))
        if "every" in taken and "rounds" in taken:
            raise ConfigError("give either every or rounds, not both", here)
        every = taken.get("every", 1)
        if not _is_round(every):
            raise ConfigError(f"every must be an integer >= 1, got {brief(every)}", f"{here}.every")
        specs.append(DiagnosticSpec(comp.name, every, comp.params, _parse_rounds(taken.get("rounds"), f"{here}.rounds")))
    return specs


def _is_round(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _parse_rounds(raw: Any, where: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(_is_round(r) for r in raw):
        raise ConfigError(f"rounds must be a non-empty list of integers >= 1, got {brief(raw)}", where)
    if len(set(raw)) != len(raw):
        raise ConfigError(f"rounds lists a round twice: {brief(raw)}", where)
    return tuple(sorted(raw))


@dataclass
class DataConfig:
    dataset: Component = component("dataset")
    """Which dataset, e.g. ``{name: fashion_mnist, root: null}``."""
    partition: Component = component("partition")
    """How training samples are split over clients, e.g. ``{name: dirichlet, alpha: 0.1}``."""
    audit_per_class: int = field(default=0, metadata={"ge": 0, "le": 1_000_000})
    """The server-held audit set: this many training samples of each class (seeded) are
    held out from every client and given to server-side diagnostics as the data set
    ``audit``. 0: no audit set. Never the test set."""


@dataclass
class FederationConfig:
    num_clients: int = field(default=10, metadata={"ge": 1, "le": 100_000})
    """Number of partitions; must equal the number of SuperNodes."""
    num_rounds: int = field(default=5, metadata={"ge": 1, "le": 100_000})
    """Aggregation rounds; the diagnostics run after those their ``every`` names."""
    clients_per_round: int | None = field(default=None, metadata={"ge": 1, "le": 100_000})
    """Clients sampled per round by partition-id with a seeded RNG; null means all."""
    on_client_failure: Literal["fail", "continue"] = "fail"
    """What a failed client (it raised, timed out or sent NaN/Inf weights) does: ``fail``
    stops the run; ``continue`` drops it and goes on."""
    min_replies: int = field(default=1, metadata={"ge": 1, "le": 100_000})
    """With ``continue``: fewer successful replies than this fails the round."""
    round_timeout_s: float = field(default=3600.0, metadata={"gt": 0.0})
    """How long the server waits for the replies of one round; later replies fail."""
    checkpoint_every: int = field(default=1, metadata={"ge": 1, "le": 100_000})
    """Write ``checkpoints/round_NNN`` every N rounds, after the last, and after every round
    a diagnostic ran in (so ``fedmech diagnose`` can rerun it there). Independent of the
    resume point (``state.safetensors``), which is replaced every round."""


@dataclass
class SimulationConfig:
    """Where and with what the simulated clients run (Ray). The Deployment Engine ignores
    all but ``cpus_per_client`` (the torch thread count of every client)."""

    cpus_per_client: int = field(default=1, metadata={"ge": 1, "le": 1024})
    """CPU cores per client (Ray resource); also the client's torch thread count."""
    gpus_per_client: float = field(default=0.0, metadata={"ge": 0.0, "le": 1.0})
    """Fraction of a GPU per client, e.g. 0.25 runs four clients per GPU: a Ray resource,
    which caps how many clients run at once; ``device`` decides where they train."""
    ray_address: str | None = None
    """An existing Ray cluster to run on: ``auto`` (the one started on this machine with
    ``ray start``) or its ``HOST:PORT``; null starts a private Ray instance per run."""


RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
"""A run name: it becomes a folder name under the output root, so never a path, nor an
option (``-x``) to a command it is passed to, nor a formula (``-A1``) in a spreadsheet."""


def _parse_name(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not RUN_NAME.fullmatch(raw):
        raise ConfigError(
            f"name must be letters, digits, '.', '_' or '-' (starting with a letter, a digit or '_', at most "
            f"200 characters), got {brief(raw)}: it names the run folder inside the output root",
            where,
        )
    return raw


@dataclass
class ExperimentConfig:
    """One experiment, validated from its YAML file: what a plug-in's ``check(params, cfg,
    data, where)`` reads of the rest of the run (``cfg.client.optimizer``,
    ``cfg.federation.num_rounds``). Every key is in the configuration reference.

    Examples
    --------
    >>> def check(params, cfg, data, where):  # a registration's check=
    ...     if cfg.federation.num_rounds < 2:
    ...         raise ConfigError("needs at least 2 rounds", where)
    """

    name: str = field(metadata={"parse": _parse_name})
    """Names the run folder, ``<output_root>/<name>-<UTC time>``; a slug, never a path."""
    data: DataConfig
    model: Component = component("model")
    client: Component = component("client")
    strategy: Component = component("strategy")
    plugins: list[str] = field(default_factory=list)
    """Your own plug-in modules, e.g. ``[my_lab.fed.median]``: imported before the rest of
    the experiment is validated, on the server and on every client, so the names they
    register may be chosen here. Each must be importable there (installed, or on PYTHONPATH)."""
    seed: int = 0
    """Seeds everything: the partition, the model's initial weights, each client's
    training and every diagnostic's random stream (``seeds.seed_for``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where models train and are diagnosed: ``auto`` takes CUDA where torch sees it, else
    the CPU (in each process: the server, every client); ``cuda`` is refused where torch
    sees no CUDA, since the server evaluates and diagnoses on this machine."""
    output_root: str = "~/fedmech-runs"
    """Where run folders go: absolute or ``~/...`` (the ServerApp's working directory is
    the SuperLink's, not your project). ``--out`` or ``FEDMECH_OUT`` override it."""
    tensorboard: bool = True
    """Write TensorBoard event files of every declared metric into the run folder."""
    eval_batch_size: int = field(default=1000, metadata={"ge": 1, "le": 1_000_000})
    """Images per forward pass when the server tests the global model (memory, not results)."""
    pruning: PruningConfig = field(default_factory=PruningConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    diagnostics: list[DiagnosticSpec] = field(default_factory=list, metadata={"parse": _parse_diagnostics})

    def to_plain(self) -> dict[str, Any]:
        """The resolved config as plain data (saved in the run folder, sent to clients)."""
        return {f: to_plain(getattr(self, f)) for f in self.__dataclass_fields__}

    def to_json(self) -> str:
        return json.dumps(self.to_plain(), sort_keys=True)


@dataclass
class FlowerAppConfig:
    """The diagnostics of a user's own Flower app (``fedmech_flwr.app.flower``): what an
    experiment says of a run, less the data, model, client and strategy, which the app
    owns. Saved as the run folder's config and sent to the app's clients."""

    num_classes: int = field(metadata={"ge": 2, "le": 100_000})
    name: str = field(default="flower-app", metadata={"parse": _parse_name})
    """Names the run folder, ``<output_root>/<name>-<UTC time>``."""
    seed: int = 0
    """Seeds the round protocol's and the diagnostics' random streams (``seeds.seed_for``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the diagnostics run; ``auto`` takes CUDA when it is there."""
    output_root: str = "~/fedmech-runs"
    """Where run folders go: absolute or ``~/...``."""
    tensorboard: bool = True
    """Write TensorBoard event files of every declared metric into the run folder."""
    eval_batch_size: int = field(default=1000, metadata={"ge": 1, "le": 1_000_000})
    """Images per forward pass when the server tests the global model (memory, not results)."""
    include_head: bool = False
    """Count the classifier head in the eval record's ``sparsity``."""
    federation: FederationConfig = field(default_factory=FederationConfig)
    """``num_clients`` SuperNodes, each started with a ``partition-id``; sampling, the
    failed-client policy and checkpoints as in an experiment. ``num_rounds`` and
    ``round_timeout_s`` come from ``start``'s arguments."""
    diagnostics: list[DiagnosticSpec] = field(default_factory=list, metadata={"parse": _parse_diagnostics})

    @property
    def pruning(self) -> PruningConfig:
        """What the server's evaluation reads of pruning: whether the head counts."""
        return PruningConfig(mode="dense", include_head=self.include_head)

    to_plain = ExperimentConfig.to_plain
    to_json = ExperimentConfig.to_json


def _check_cross_field(cfg: ExperimentConfig, where: str) -> None:
    _check_federation(cfg.federation, where)
    _check_pairing(cfg, where)
    address = cfg.simulation.ray_address
    if address is not None and address != "auto" and not re.fullmatch(r"[\w.\-]+:\d+", address):
        raise ConfigError(
            f"ray_address must be 'auto', HOST:PORT (the address `ray start --head` prints) or null, "
            f"got {brief(address)}",
            f"{where}simulation.ray_address",
        )
    root = cfg.output_root
    if not (Path(root).is_absolute() or root.startswith("~")):
        raise ConfigError(
            f"output_root must be absolute or start with '~', got {brief(root)}: the ServerApp runs "
            "in the SuperLink's working directory, so a relative path would land somewhere "
            "unexpected (use --out DIR or FEDMECH_OUT for a folder relative to you)",
            f"{where}output_root",
        )


def _check_federation(fed: FederationConfig, where: str) -> None:
    if fed.clients_per_round is not None and fed.clients_per_round > fed.num_clients:
        raise ConfigError(
            f"clients_per_round ({fed.clients_per_round}) must be <= num_clients ({fed.num_clients})",
            f"{where}federation.clients_per_round",
        )
    sampled = fed.clients_per_round or fed.num_clients
    if fed.min_replies > sampled:
        raise ConfigError(
            f"min_replies ({fed.min_replies}) must be <= the clients sampled per round ({sampled})",
            f"{where}federation.min_replies",
        )


def _check_pairing(cfg: ExperimentConfig, where: str) -> None:
    """A client or strategy that only works with certain partners (FedProx and its
    proximal client, FedBABU and its frozen-head client) is never silently mismatched."""
    names = {"client": cfg.client.name, "strategy": cfg.strategy.name}
    for kind, partner in PARTNERS.items():
        allowed = _registry(kind).get(names[kind]).pairs_with
        if allowed and names[partner] not in allowed:
            raise ConfigError(
                f"{kind} '{names[kind]}' needs {partner} {' or '.join(repr(a) for a in allowed)}, "
                f"got '{names[partner]}'; set {partner}.name accordingly",
                f"{where}{partner}.name",
            )


def _check_text(node: Any, where: str) -> None:
    """Refuse a control character in any key or string of a raw config (``\\e`` or
    ``\\n`` written in a quoted YAML string): config text ends up in folder names, on the
    console and in the report, where it would act rather than read."""
    if isinstance(node, str) and (found := CONTROL.search(node)):
        raise ConfigError(f"got {brief(node)}, which holds the control character '{printable(found.group())}': "
                          "a config value is plain text on one line; remove it", where)
    if isinstance(node, dict):
        for key, value in node.items():
            here = join_key(where, printable(str(key)))
            _check_text(key, here)
            _check_text(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_text(value, f"{where}[{i}]")


def parse_structure(raw: Any, source: str) -> ExperimentConfig:
    """A plain mapping (YAML contents) as an ExperimentConfig: keys, types, ranges, names
    and the rules between fields; no data read (``experiment.parse_experiment`` checks
    it against its data too). ``source`` names the file in error messages."""
    _check_text(raw, f"{source}:")
    load_plugins(raw, source)
    cfg = parse_dataclass(ExperimentConfig, raw, f"{source}:")
    _check_cross_field(cfg, f"{source}: ")
    return cfg


def parse_flower_app(raw: Any, source: str) -> FlowerAppConfig:
    """A plain mapping as a FlowerAppConfig: keys, types, ranges, diagnostic names and the
    federation's rules; ``source`` names where it came from in error messages."""
    _check_text(raw, f"{source}:")
    cfg = parse_dataclass(FlowerAppConfig, raw, f"{source}:")
    _check_federation(cfg.federation, f"{source}: ")
    return cfg


def load_plugins(raw: Any, source: str) -> None:
    """Import the modules a raw experiment (YAML contents) lists under ``plugins:``, which
    ``parse_structure`` does before it reads the rest; an import failure names its key."""
    modules = raw.get("plugins") if isinstance(raw, dict) else None
    if modules is None:
        return
    if not isinstance(modules, list):
        raise ConfigError(f"expected a list of module names, e.g. [my_lab.fed.median], got {brief(modules)}",
                          f"{source}: plugins")
    for i, module in enumerate(modules):
        plugins.import_plugin(module, f"{source}: plugins[{i}]")


def set_key(raw: dict[str, Any], dotted: str, value: Any, where: str = "--set") -> None:
    """Set ``a.b.c`` in a raw config mapping to ``value`` (made of plain YAML data),
    creating the mappings on the way."""
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        if node.get(key) is None:  # absent, or an empty YAML section (parsed as {} too)
            node[key] = {}
        node = node[key]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: '{key}' is not a mapping", where)
    node[keys[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML) to a raw config mapping."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r}", "--set")
        dotted, value_text = item.split("=", 1)
        set_key(out, dotted, load_yaml(value_text, f"--set {dotted}"))
    return out


def override(dotted: str, value: Any) -> str:
    """The ``--set`` item that sets ``dotted`` to ``value`` (``apply_overrides`` reads it
    back as the same value: YAML flow style, which also keeps 1e-05 a number)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 30).strip()
    return f"{dotted}={text.removesuffix('...').strip()}"


def flatten_plain(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a plain config; list entries with a ``name`` (plug-ins such as
    diagnostics) are keyed by it, so ``diagnostics.misalignment.every``."""
    if isinstance(node, list) and node and all(isinstance(v, dict) and "name" in v for v in node):
        node = {v["name"]: v for v in node}
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in flatten_plain(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Dotted keys whose value (or presence) differs between plain configs."""
    flat = [flatten_plain(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    return [k for k in keys if len({json.dumps(f.get(k, "<absent>"), sort_keys=True) for f in flat}) > 1]


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read an experiment or sweep file: a mapping, or a clear error (missing, not UTF-8,
    malformed, a key twice, an alias bomb, not a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path.resolve()}")
    raw = read_yaml_file(path)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"expected an experiment or sweep file, a mapping of keys (name:, data:, ...), got "
                          f"{shape(raw)}", str(path))
    return raw


def experiment_from_json(text: str) -> ExperimentConfig:
    """Rebuild the resolved config that the ServerApp sends to clients. The ServerApp
    checked it against the data at start; a node's copy of the data may live elsewhere
    (``data-root``), so only its structure is validated here."""
    return parse_structure(json.loads(text), "config from the ServerApp")
