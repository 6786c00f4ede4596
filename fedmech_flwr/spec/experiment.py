"""Building blocks shared by the ServerApp and the ClientApp for one experiment config.

Both sides derive the same data, partitions and model from the resolved config and the
seed, so a client can rebuild its shard from its partition-id alone. Decoded datasets and
partitions are cached per process (Ray actors serve many clients); nothing per-client is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedmech_flwr.datasets.data import DataInfo, DatasetBundle, dataset_info, load_dataset
from fedmech_flwr.datasets.partition import partition_dataset
from fedmech_flwr.foundation.errors import ConfigError, DataNotFoundError
from fedmech_flwr.foundation.seeds import numpy_rng, seed_for, seeded_globals
from fedmech_flwr.foundation.typed import join_key, to_plain
from fedmech_flwr.learning.arrays import NamedArrays, load_model_arrays
from fedmech_flwr.models import FedMechModel, build_model
from fedmech_flwr.spec.config import (
    PLUGIN_KEYS,
    ExperimentConfig,
    apply_overrides,
    parse_structure,
    plugin_registries,
    read_yaml,
)


def memory_available_gib() -> float:
    """Memory this host can still give (``MemAvailable``), in GiB; infinite where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


_PARTITIONS: dict[str, list[np.ndarray]] = {}


def load_data(cfg: ExperimentConfig) -> DatasetBundle:
    return load_dataset(cfg.data.dataset.name, cfg.data.dataset.params)


def parse_experiment(raw: Any, source: str) -> ExperimentConfig:
    """Validate a plain mapping (YAML contents) into an ExperimentConfig
    (``config.parse_structure``), then check it against its data and every chosen
    plug-in's own rules (``check_experiment``): what parses here, the ServerApp accepts at
    start.

    ``source`` names the file in error messages. Call ``fedmech_flwr.contracts.plugins.load()``
    first so every plug-in has registered its name and config.
    """
    cfg = parse_structure(raw, source)
    check_experiment(cfg, f"{source}:")
    return cfg


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate an experiment file."""
    raw = apply_overrides(read_yaml(path), overrides or [])
    return parse_experiment(raw, str(path))


def check_simulated(cfg: ExperimentConfig, where: str) -> None:
    """The rules of a run on Flower's simulation engine (``fedmech run``, a sweep's cells), not
    of a deployment: ``device: cuda`` needs GPU shares, since Ray empties
    ``CUDA_VISIBLE_DEVICES`` in an actor that asks for none (Ray 2.55's default); GPU shares
    on a private Ray need a GPU here, or Flower starts no client ("ActorPool is empty")."""
    sim = cfg.simulation
    if cfg.device == "cuda" and sim.gpus_per_client == 0:
        raise ConfigError(
            "device is 'cuda' but simulation.gpus_per_client is 0: Ray hides the GPUs from a client's actor that "
            "asks for none, so every client would fail; set simulation.gpus_per_client (0.25 runs four clients "
            "per GPU), or device: auto (the clients on the CPU)", f"{where}simulation.gpus_per_client")
    if sim.gpus_per_client > 0 and sim.ray_address is None and not torch.cuda.is_available():
        raise ConfigError(
            f"simulation.gpus_per_client is {sim.gpus_per_client:g} but this machine has no GPU (torch sees no "
            "CUDA) for its private Ray to share out, so no client could start; set simulation.gpus_per_client: 0, "
            "or name a Ray cluster with GPUs in simulation.ray_address", f"{where}simulation.gpus_per_client")


def check_experiment(cfg: ExperimentConfig, where: str = "") -> None:
    """Every check of ``cfg`` that can be made before Flower starts.

    Refuses ``device: cuda`` where torch sees no CUDA (the ServerApp would fail at start),
    reads the dataset's labels and checks its files' headers (not its images), then runs
    what the ServerApp runs at start: the audit set, the clients' partitions, the model,
    and each chosen plug-in's own ``check`` (``Entry.check``). ``where`` prefixes the key
    paths in errors (e.g. ``"x.yaml:"``). Labels and partitions are cached, so a sweep's
    cells cost milliseconds each.
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device is 'cuda' but torch sees no CUDA device on this machine, where the server evaluates and "
            "diagnoses even when simulation.ray_address sends the clients to a cluster; set device: auto "
            "(CUDA wherever a process has it, else the CPU) or device: cpu", join_key(where, "device"))
    dataset = cfg.data.dataset
    described = f"dataset '{dataset.name}' with {to_plain(dataset.params)}"
    try:
        data = dataset_info(dataset.name, dataset.params)
    except DataNotFoundError as err:
        raise ConfigError(f"{described} is not on this machine\n{err}", join_key(where, "data.dataset")) from err
    except ConfigError as err:  # a dataset's own rule, at its key
        raise ConfigError(err.message, join_key(where, err.where)) from err
    except ValueError as err:  # a foreign or damaged file
        raise ConfigError(f"{described} cannot be read: {err}", join_key(where, "data.dataset")) from err
    data = dataclasses.replace(data, audit_per_class=cfg.data.audit_per_class)
    try:  # the core's own rules, which name their keys relative to the experiment
        client_partitions(cfg, data)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # shapes only: no weight is allocated
            model = build_model(cfg.model.name, cfg.model.params, in_channels=data.input_shape[0],
                                num_classes=data.num_classes, image_size=data.input_shape[1])
    except ConfigError as err:
        raise ConfigError(err.message, join_key(where, err.where)) from err
    check_memory(cfg, data, model, where)
    for i, spec in enumerate(cfg.diagnostics):
        late = [r for r in spec.rounds or () if r > cfg.federation.num_rounds]
        if late:
            raise ConfigError(f"rounds {late} come after the last round ({cfg.federation.num_rounds}) and would never run",
                              join_key(where, f"{PLUGIN_KEYS['diagnostic']}[{i}].rounds"))
    registries = plugin_registries()
    for kind, chosen, key in _chosen(cfg):
        check = registries[kind].get(chosen.name).check
        if check is not None:
            check(chosen.params, cfg, data, join_key(where, key))


def check_memory(cfg: ExperimentConfig, data: DataInfo, model: FedMechModel, where: str = "") -> None:
    """Refuse, in one line, an experiment whose estimated memory (``memory_needed``) is
    more than this machine has available, before anything is allocated: a typo such as
    ``image_size: 100000`` must not take the memory every other process on it uses."""
    available = memory_available_gib() * 2**30  # infinite where unknown: nothing refused
    need, parts = memory_needed(cfg, data, model)
    if need > available:
        raise ConfigError(
            f"this experiment needs about {_gib(need)} of memory ({parts}), more than the {_gib(available)} this "
            "machine has available (MemAvailable in /proc/meminfo); make the images, the data, the model or the "
            "batches smaller (data.dataset, model, train.batch_size, eval_batch_size), or run fewer clients at "
            "once (simulation.cpus_per_client)", join_key(where, "data.dataset"))


def memory_needed(cfg: ExperimentConfig, data: DataInfo, model: FedMechModel) -> tuple[int, str]:
    """Bytes a run of ``cfg`` takes on this machine at least, and what they are made of.

    Every process holds the whole dataset as float32 tensors (``load_dataset``) and the
    model: the server with each sampled client's reply, and, on a private Ray, each client
    actor (one per ``cpus_per_client`` CPUs, at most one per client) with its gradients,
    two optimiser moments and a training batch's activations and their gradients. Clients
    on a Ray cluster (``simulation.ray_address``) count there, not here. ``model`` may live
    on the meta device: only its shapes are read. Diagnostics' own buffers are not
    counted, so a refusal never comes from an over-estimate."""
    samples = data.num_train + data.num_test
    data_bytes = samples * (math.prod(data.input_shape) * 4 + 8)
    weights = 4 * sum(p.numel() for p in model.parameters())
    activations = 4 * _activation_elements(model, data.input_shape)
    sampled = cfg.federation.clients_per_round or cfg.federation.num_clients
    server = data_bytes + weights * (2 + sampled) + activations * cfg.eval_batch_size
    client = data_bytes + weights * 5 + 2 * activations * cfg.train.batch_size
    cpus = cfg.simulation.cpus_per_client
    actors = 0 if cfg.simulation.ray_address else min(os.cpu_count() or 1, cfg.federation.num_clients * cpus) // cpus
    parts = (f"the data {_gib(data_bytes)} in each of {1 + actors} processes, the server's model and replies "
             f"{_gib(server - data_bytes)}, each of {actors} client(s)' training {_gib(client - data_bytes)}")
    return server + actors * client, parts


def _activation_elements(model: FedMechModel, input_shape: tuple[int, int, int]) -> int:
    """Elements of every module's output for one image: a forward pass on the meta device,
    which computes shapes only (0 for a model whose forward needs real values)."""
    total = 0

    def count(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal total
        total += output.numel() if isinstance(output, torch.Tensor) else 0

    meta = model.to("meta")
    hooks = [m.register_forward_hook(count) for m in meta.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            meta(torch.empty((1, *input_shape), device="meta"))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        total = 0
    finally:
        for hook in hooks:
            hook.remove()
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _chosen(cfg: ExperimentConfig) -> list[tuple[str, Any, str]]:
    """(kind, chosen component, its key) of every plug-in ``cfg`` uses."""
    single = {"dataset": cfg.data.dataset, "partition": cfg.data.partition, "model": cfg.model,
              "client": cfg.client, "strategy": cfg.strategy}
    return [(kind, component, PLUGIN_KEYS[kind]) for kind, component in single.items()] + [
        ("diagnostic", spec, f"{PLUGIN_KEYS['diagnostic']}[{i}]") for i, spec in enumerate(cfg.diagnostics)
    ]


def audit_indices(cfg: ExperimentConfig, bundle: DatasetBundle | DataInfo) -> np.ndarray:
    """Training-set indices of the server's audit set: ``data.audit_per_class`` samples of
    every class, seeded, sorted (empty without an audit set)."""
    return balanced_indices(bundle.y_train.numpy(), bundle.num_classes, cfg.data.audit_per_class, cfg.seed)


def balanced_indices(labels: np.ndarray, num_classes: int, per_class: int, seed: int) -> np.ndarray:
    """``per_class`` indices of every class of ``labels``, drawn from the run seed's
    audit-set stream and sorted: the audit set ``audit_indices`` holds out, for a user's
    own Flower app too (``examples/flower-fedavgm``)."""
    if per_class == 0:
        return np.zeros(0, dtype=np.int64)
    rng = numpy_rng(seed, "audit-set")
    picks = []
    for c in range(num_classes):
        pool = np.flatnonzero(labels == c)
        if len(pool) <= per_class:
            raise ConfigError(
                f"audit_per_class ({per_class}) must be below the {len(pool)} training samples of class {c}",
                "data.audit_per_class",
            )
        picks.append(rng.choice(pool, size=per_class, replace=False))
    return np.sort(np.concatenate(picks)).astype(np.int64)


def check_disjoint_from_test(audit_x: torch.Tensor, test_x: torch.Tensor) -> None:
    """The audit set must share no image with the test set (byte-identical images are
    found by hash), or every number the server measures on it leaks the test set."""
    if not len(audit_x):
        return
    shared = len(_image_digests(audit_x) & _image_digests(test_x))
    if shared:
        raise ConfigError(
            f"the audit set shares {shared} image(s) with the test set; the dataset's training "
            "split contains test images. Remove them from the training data, or set "
            "data.audit_per_class=0 to run without an audit set",
            "data.audit_per_class",
        )


def _image_digests(x: torch.Tensor) -> set[str]:
    return {hashlib.sha1(image.tobytes()).hexdigest() for image in x.cpu().numpy()}


def client_partitions(cfg: ExperimentConfig, bundle: DatasetBundle | DataInfo,
                      audit: np.ndarray | None = None) -> list[np.ndarray]:
    """Training-set indices of every client (deterministic in the config and seed); the
    audit set, if any, is held out before partitioning: ``audit``, where the caller holds
    ``audit_indices`` already, else computed. Labels are all it reads, so the check before
    a run (``check_experiment``) draws the very partitions the run uses."""
    key = repr((to_plain(cfg.data), cfg.federation.num_clients, cfg.seed))
    if key not in _PARTITIONS:
        part = cfg.data.partition
        held_out = audit_indices(cfg, bundle) if audit is None else audit
        available = np.setdiff1d(np.arange(len(bundle.y_train)), held_out)
        labels = bundle.y_train.numpy()[available]
        parts = partition_dataset(part.name, part.params, labels, cfg.federation.num_clients, cfg.seed)
        _PARTITIONS[key] = [available[p] for p in parts]
    return _PARTITIONS[key]


class ImageShape(Protocol):
    """What a model is built for: a ``DatasetBundle``, or the server's ``NodeDataSpec`` on a
    node with its own data."""

    @property
    def in_channels(self) -> int: ...
    @property
    def num_classes(self) -> int: ...
    @property
    def image_size(self) -> int: ...


def new_model(cfg: ExperimentConfig, bundle: ImageShape, device: torch.device | str = "cpu") -> FedMechModel:
    """The model of this experiment for ``bundle``'s images and classes; weights are
    seeded by ``cfg.seed``, and the process-wide RNGs are left as they were."""
    with seeded_globals(seed_for(cfg.seed, "model-init")):
        model = build_model(
            cfg.model.name,
            cfg.model.params,
            in_channels=bundle.in_channels,
            num_classes=bundle.num_classes,
            image_size=bundle.image_size,
        )
    return model.to(device)


def model_builder(cfg: ExperimentConfig, bundle: DatasetBundle, device: torch.device) -> Callable[[NamedArrays], FedMechModel]:
    """``build(arrays)``: a fresh model of this experiment holding ``arrays``, in eval mode."""

    def build(arrays: NamedArrays) -> FedMechModel:
        model = new_model(cfg, bundle, device)
        load_model_arrays(model, arrays)
        return model.eval()

    return build
