"""``fedmech run``'s front end: an experiment file made into a ``RunInputs`` for ``Run``.

The ServerApp of ``fedmech run`` (and the in-process runner) call ``run_experiment``; the
server's side of the experiment (``ServerData``, ``new_strategy``) is derived from the
config and seed alone, so ``fedmech diagnose`` makes it again as the run made it. A user's
own Flower app has the other front end, ``fedmech_flwr.app.flower.WithDiagnostics``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedmech_flwr.app.node_data import NodeDataSpec
from fedmech_flwr.app.run import LabelledSet, Run, RunInputs, output_root
from fedmech_flwr.artifacts.folder import CONFIG_FILE, RunFolder
from fedmech_flwr.contracts.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.contracts.wire import CONFIG_KEY, DATA_SPEC_KEY
from fedmech_flwr.datasets.data import DatasetBundle
from fedmech_flwr.datasets.partition import label_histograms
from fedmech_flwr.learning.arrays import NamedArrays, model_arrays
from fedmech_flwr.learning.pruning import prune_to
from fedmech_flwr.learning.training import resolve_device
from fedmech_flwr.spec.config import ExperimentConfig
from fedmech_flwr.spec.experiment import (
    audit_indices,
    check_disjoint_from_test,
    client_partitions,
    load_data,
    load_experiment,
    model_builder,
    new_model,
)


def resume_config(run_dir: str | Path) -> ExperimentConfig:
    """The resolved config saved in a run folder that can be resumed (else a clear error)."""
    return load_experiment(RunFolder.resume(run_dir).path / CONFIG_FILE)


def run_experiment(grid: Grid, cfg: ExperimentConfig, *, out: str | None = None, run_dir: str | None = None,
                   run_config: dict[str, Any] | None = None, resume: bool = False) -> Path:
    """Run ``cfg`` on ``grid``; return the run folder. Bad input fails before it exists.

    With ``resume``, ``run_dir`` is a killed run's folder (and ``cfg`` its config): the run
    continues there from the last round the folder committed.
    """
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = resolve_device(cfg.device)
    server = ServerData.of(cfg, device)
    bundle, parts, datasets = server.bundle, server.parts, server.datasets
    initial = model_arrays(new_model(cfg, bundle, device))
    build = model_builder(cfg, bundle, device)
    hist = label_histograms(parts, bundle.y_train.numpy(), bundle.num_classes).astype(int)
    pruning = cfg.pruning
    inputs = RunInputs(
        cfg, cfg.to_plain(), new_strategy(cfg, server, initial, build), build, device,
        bundle.num_classes, list(bundle.class_names), datasets,
        identify=ConfigRecord({CONFIG_KEY: cfg.to_json(), DATA_SPEC_KEY: NodeDataSpec.of(bundle).to_json()}),
        out_root=output_root(cfg, out), run_dir=run_dir, resume=resume,
        shards={partition_id: (len(part), hist[partition_id].tolist())
                for partition_id, part in enumerate(parts)},
        reprune=partial(_reprune, cfg, build) if pruning.mode == "magnitude" and pruning.server_reprune else None,
        run_config=run_config or {},
    )
    run = Run(inputs)
    run.execute(grid, initial)
    return run.folder.path


@dataclass(frozen=True)
class ServerData:
    """What the server of ``fedmech run``'s own experiment holds: the dataset, every
    client's partition, and the labelled sets its diagnostics read (``RoundState.datasets``:
    ``test``, ``audit`` when the config names one, ``pooled`` when a diagnostic needs it)."""

    bundle: DatasetBundle
    parts: list[np.ndarray]
    datasets: dict[str, LabelledSet]

    @classmethod
    def of(cls, cfg: ExperimentConfig, device: torch.device) -> ServerData:
        """Derived from the config and seed alone, as the run made them (``fedmech diagnose``
        makes them again); the audit set is checked against the test set."""
        bundle = load_data(cfg)
        held_out = audit_indices(cfg, bundle)
        parts = client_partitions(cfg, bundle, held_out)
        audit = torch.from_numpy(held_out)
        audit_x = bundle.x_train[audit]
        check_disjoint_from_test(audit_x, bundle.x_test)
        datasets = {"test": (bundle.x_test.to(device), bundle.y_test.to(device))}
        if len(audit):
            datasets["audit"] = (audit_x.to(device), bundle.y_train[audit].to(device))
        if any(spec.build().needs_pooled_data() for spec in cfg.diagnostics):
            pooled = torch.from_numpy(np.sort(np.concatenate(parts)))  # every client's shard: a simulation-only oracle
            datasets["pooled"] = (bundle.x_train[pooled].to(device), bundle.y_train[pooled].to(device))
        return cls(bundle, parts, datasets)


def new_strategy(cfg: ExperimentConfig, server: ServerData, initial: NamedArrays,
                 build: Callable[[NamedArrays], torch.nn.Module]) -> Strategy:
    """The experiment's strategy, built with what the server holds."""
    context = StrategyContext(
        num_classes=server.bundle.num_classes, num_rounds=cfg.federation.num_rounds, seed=cfg.seed,
        round_timeout_s=cfg.federation.round_timeout_s, initial=initial, build_model=build,
        audit=server.datasets.get("audit"), num_clients=cfg.federation.num_clients,
        pruned=cfg.pruning.mode == "magnitude",
    )
    return STRATEGIES.get(cfg.strategy.name).factory(cfg.strategy.params, context)


def _reprune(cfg: ExperimentConfig, build: Callable[[NamedArrays], torch.nn.Module], arrays: NamedArrays) -> NamedArrays:
    """The aggregate pruned back to the target sparsity (the server's mask policy)."""
    model = build(arrays)
    prune_to(model, cfg.pruning.target_sparsity, cfg.pruning)
    return model_arrays(model)
