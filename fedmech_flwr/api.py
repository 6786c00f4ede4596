"""The public face of fedmech for plug-ins: the only module a plug-in needs to import.

A plug-in (a client behaviour, a Flower strategy, a diagnostic, a model, a command; the
built-in ones in ``fedmech_flwr.builtin`` and a user's own alike) imports what it uses
from here, and from no other fedmech module, the way a Flower app imports ``flwr.app``
rather than Flower's internals. Everything listed in ``__all__`` keeps its name and
meaning within a release, and a name that moves stays here for one more release with a
``DeprecationWarning``; the modules behind it are private and may be rearranged.
``tests/test_import_graph.py`` holds the fence: the core imports no plug-in (only the
plug-in loader ``fedmech_flwr.plugins`` names the built-in packages), and a plug-in imports
neither ``fedmech_flwr.app`` nor ``fedmech_flwr.tools`` nor another plug-in nor any core
module but this one.

What is here, by role:

- **registries**: ``CLIENTS``, ``STRATEGIES``, ``DIAGNOSTICS``, ``MODELS``, ``DATASETS``,
  ``PARTITIONERS``, ``CLIENT_QUERIES`` (a strategy's client-side work), ``COMMANDS``
  (``fedmech <name>``); each ``REGISTRY.register(name, ConfigCls, pairs_with=...,
  check=..., outputs=...)`` is a decorator, and ``register(kind, name, ...)`` picks the
  registry by plug-in kind. ``Registry`` and ``Entry`` are their types.
- **clients**: ``FedMechClient`` (override ``loss`` or ``fit``) and ``ClientData``.
- **strategies**: ``WeightedFedAvg`` (the ``fedavg`` strategy; override ``average`` or one
  Flower step) with its ``FedAvgConfig``, ``StrategyContext``, ``OFFERED_NODES_ONLY``,
  ``uploaded`` (what a paired client uploads), ``parameter_names``, the client queries'
  ``QueryContext`` and ``query_nodes``, ``ReportsAnotherModel``, ``StartsFromItsOwnModel``;
  the ready-made checks ``sgd_only``, ``plain_sgd_only``, ``dense_only``, ``all_of``.
- **diagnostics**: ``Diagnostic`` and its contexts ``RoundState`` (server side),
  ``ClientContext`` and ``GlobalContext`` (client side), ``DiagnosticResult``,
  ``ClientUpdate``, ``decode_results`` (another diagnostic's compact results, by name: how
  circuit-masked averaging reads the circuits diagnostic's masks), ``Resumable`` (state
  that a resumed run restores), ``Clock``.
- **what a plug-in records**: ``Metric`` and ``Outputs`` (declared with ``outputs=`` at
  registration, so every view shows them), ``record_key``, ``one_class``, ``under_powered``,
  ``either``, ``lookup``, ``DEGENERATE_FRACTION``.
- **models**: ``FedMechModel`` (features, head, gated layers), ``build_model``,
  ``wrap_module``, ``register_module``, ``ChannelGroup``.
- **seeds**: ``seed_for``, ``numpy_rng``, ``torch_generator``: a named stream of the run's
  seed, never the process-wide generators.
- **arrays**: ``NamedArrays`` and its helpers (``weighted_mean``, ``to_record`` /
  ``from_record``, ``save_arrays`` / ``load_arrays``, ``model_arrays`` ...).
- **heads**: linear heads on frozen features (``features``, ``train_linear``, ``ClassStats``,
  ``ncm_head``, ``ccvr_head`` ...).
- **masks**: ``MaskLike``, ``to_bools``, ``pack_masks`` / ``unpack_masks``.
- **errors**: ``ConfigError`` (what was expected, what was received, where), ``BadFileError``,
  ``DataNotFoundError``, ``RunFolderError``.
- **the experiment and its files**, for commands and analyses: ``ExperimentConfig``,
  ``DataInfo``, ``load_experiment``, ``load_data``, ``model_builder``, ``read_records``,
  the run folder's file names, ``parse_dataclass``, ``write_text_atomic`` ...
- **figures** (server side; imported on first use, so a ClientApp never loads matplotlib):
  ``line_plot``, ``heatmap``, ``class_labels``.
- **tests**: ``train_replies``, mocked clients' replies for a strategy's ``aggregate_train``;
  the contract checks ``check_model``, ``check_client``, ``check_strategy``,
  ``check_diagnostic`` (a plug-in's test calls the one of its kind).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from fedmech_flwr.arrays import (
    NamedArrays,
    cast,
    from_record,
    l2_norm,
    load_arrays,
    load_model_arrays,
    model_arrays,
    save_arrays,
    to_record,
    weighted_mean,
)
from fedmech_flwr.checks import Check, all_of, dense_only, plain_sgd_only, sgd_only
from fedmech_flwr.client import CLIENTS, ClientData, FedMechClient
from fedmech_flwr.commands import COMMANDS, Command, Help
from fedmech_flwr.config import ExperimentConfig, apply_overrides, plugin_registries
from fedmech_flwr.contracts import check_client, check_diagnostic, check_model, check_strategy
from fedmech_flwr.data import DATASETS, DataInfo
from fedmech_flwr.errors import BadFileError, ConfigError, DataNotFoundError, RunFolderError
from fedmech_flwr.experiment import audit_indices, load_data, load_experiment, model_builder
from fedmech_flwr.files import save_figure, write_text_atomic
from fedmech_flwr.heads import (
    ClassStats,
    Covariance,
    LinearHead,
    LinearTrainConfig,
    Scores,
    balanced_split,
    best_epoch,
    ccvr_head,
    ccvr_train_config,
    class_stats,
    features,
    features_at,
    head_set_per_class,
    ncm_head,
    score,
    tau_normalize,
    train_linear,
)
from fedmech_flwr.hooks import (
    DIAGNOSTICS,
    ClientContext,
    ClientUpdate,
    Diagnostic,
    DiagnosticResult,
    GlobalContext,
    Resumable,
    RoundState,
    decode_results,
)
from fedmech_flwr.masks import MaskLike, pack_masks, to_bools, unpack_masks
from fedmech_flwr.models import MODELS, ChannelGroup, FedMechModel, build_model, register_module, wrap_module
from fedmech_flwr.outputs import DEGENERATE_FRACTION, Metric, Outputs, either, lookup, one_class, under_powered
from fedmech_flwr.partition import PARTITIONERS
from fedmech_flwr.registry import Entry, Registry
from fedmech_flwr.run_folder import CHECKPOINT_DIR, CONFIG_FILE, FINAL_MODEL_FILE, read_records, record_key, round_file
from fedmech_flwr.seeds import numpy_rng, seed_for, torch_generator
from fedmech_flwr.strategy import (
    CLIENT_QUERIES,
    OFFERED_NODES_ONLY,
    SENT_ACCURACY,
    SENT_LOSS,
    STRATEGIES,
    FedAvgConfig,
    QueryContext,
    ReportsAnotherModel,
    StartsFromItsOwnModel,
    StrategyContext,
    WeightedFedAvg,
    parameter_names,
    uploaded,
    weighted_fedavg,
)
from fedmech_flwr.testing import train_replies
from fedmech_flwr.timing import Clock
from fedmech_flwr.training import (
    a_norm,
    channels_last,
    channels_last_copy,
    largest_predicted_class,
    make_optimizer,
    resolve_device,
)
from fedmech_flwr.typed import join_key, parse_dataclass, to_plain
from fedmech_flwr.wire import REPORT_KEY, query_nodes
from fedmech_flwr.yaml_text import read_yaml_file

__all__ = [
    # registries and registration
    "CLIENTS", "CLIENT_QUERIES", "COMMANDS", "DATASETS", "DIAGNOSTICS", "MODELS", "PARTITIONERS", "STRATEGIES",
    "Entry", "Registry", "plugin_registries", "register",
    # clients
    "ClientData", "FedMechClient", "a_norm", "make_optimizer",
    # strategies
    "FedAvgConfig", "OFFERED_NODES_ONLY", "QueryContext", "REPORT_KEY", "ReportsAnotherModel", "SENT_ACCURACY",
    "SENT_LOSS", "StartsFromItsOwnModel", "StrategyContext", "WeightedFedAvg", "parameter_names", "query_nodes",
    "uploaded", "weighted_fedavg",
    "Check", "all_of", "dense_only", "plain_sgd_only", "sgd_only",
    # diagnostics
    "ClientContext", "ClientUpdate", "Clock", "Diagnostic", "DiagnosticResult", "GlobalContext", "Resumable",
    "RoundState", "decode_results",
    # what a plug-in records
    "DEGENERATE_FRACTION", "Metric", "Outputs", "either", "lookup", "one_class", "record_key", "under_powered",
    # models
    "ChannelGroup", "FedMechModel", "build_model", "register_module", "wrap_module",
    "channels_last", "channels_last_copy", "largest_predicted_class", "resolve_device",
    # seeds
    "numpy_rng", "seed_for", "torch_generator",
    # arrays
    "NamedArrays", "cast", "from_record", "l2_norm", "load_arrays", "load_model_arrays", "model_arrays",
    "save_arrays", "to_record", "weighted_mean",
    # heads
    "ClassStats", "Covariance", "LinearHead", "LinearTrainConfig", "Scores", "balanced_split", "best_epoch",
    "ccvr_head", "ccvr_train_config", "class_stats", "features", "features_at", "head_set_per_class", "ncm_head",
    "score", "tau_normalize", "train_linear",
    # masks
    "MaskLike", "pack_masks", "to_bools", "unpack_masks",
    # errors
    "BadFileError", "ConfigError", "DataNotFoundError", "RunFolderError",
    # the experiment and its files
    "CHECKPOINT_DIR", "CONFIG_FILE", "FINAL_MODEL_FILE", "Command", "DataInfo", "ExperimentConfig", "Help",
    "apply_overrides", "audit_indices", "join_key", "load_data", "load_experiment", "model_builder",
    "parse_dataclass", "read_records", "read_yaml_file", "round_file", "save_figure", "to_plain",
    "write_text_atomic",
    # figures (imported on first use)
    "class_labels", "heatmap", "line_plot",
    # tests
    "check_client", "check_diagnostic", "check_model", "check_strategy", "train_replies",
]

_FIGURES = ("class_labels", "heatmap", "line_plot")
"""``fedmech_flwr.plotting``'s helpers, imported on first use: matplotlib is the server's
alone, and every ClientApp imports the plug-ins (and so this module)."""


def __getattr__(name: str) -> Any:
    if name in _FIGURES:
        from fedmech_flwr import plotting

        return getattr(plotting, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(kind: str, name: str, config_cls: type | None = None, **options: Any) -> Callable[[Any], Any]:
    """Decorator: register a plug-in of ``kind`` (``client``, ``strategy``, ``diagnostic``,
    ``model``, ``dataset``, ``partition``) as ``name``; the same as
    ``<REGISTRY>.register(name, config_cls, **options)`` of that kind's registry
    (``pairs_with``, ``check``, ``outputs``: see ``Entry``), the entry's module the caller's."""
    registries = plugin_registries()
    if kind not in registries:
        raise ConfigError(f"unknown plug-in kind '{kind}'; choose one of: {', '.join(registries)}", "register")
    module = options.pop("module", None) or sys._getframe(1).f_globals.get("__name__", "?")
    return registries[kind].register(name, config_cls, module=module, **options)
