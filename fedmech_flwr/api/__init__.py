"""The public API for plug-ins: what a client, a strategy, a diagnostic, a model, a command
or a data plug-in may import, one module per role, each with its own ``__all__``.

======================================  =============================================
``fedmech_flwr.api``                    shared: errors, the ``check`` arguments, seeds,
                                        declared metrics
``fedmech_flwr.api.client``             a client behaviour (``CLIENTS``, ``FedMechClient``)
``fedmech_flwr.api.strategy``           a Flower strategy (``STRATEGIES``, ``WeightedFedAvg``)
``fedmech_flwr.api.diagnostic``         a diagnostic (``DIAGNOSTICS``, ``Diagnostic``)
``fedmech_flwr.api.model``              a model (``MODELS``, ``FedMechModel``, ``wrap_module``)
``fedmech_flwr.api.command``            a ``fedmech`` subcommand (``COMMANDS``, ``Command``)
``fedmech_flwr.api.data``               a dataset or a partition (``DATASETS``, ``PARTITIONERS``)
======================================  =============================================

Every role registers the same way, with its registry's decorator
``REGISTRY.register(name, ConfigCls, pairs_with=..., check=..., outputs=...)``
(``fedmech_flwr.foundation.registry.Registry.register``). The names in these ``__all__`` keep their
name and meaning within a release; one that moves stays for one more release with a
``DeprecationWarning`` naming its new place. Everything else of fedmech is private and may
change, ``fedmech_flwr.api._builtin`` (what only the built-in plug-ins use) included:
``tests/test_import_graph.py`` holds that fence.

Examples
--------
>>> from fedmech_flwr.api import ConfigError, seed_for
>>> from fedmech_flwr.api.strategy import STRATEGIES, WeightedFedAvg
"""

from __future__ import annotations

import importlib
from typing import Any

from fedmech_flwr.contracts.outputs import Metric, Outputs
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.seeds import numpy_rng, seed_for, torch_generator
from fedmech_flwr.spec.config import ExperimentConfig

FACES = ("client", "strategy", "diagnostic", "model", "command", "data")
"""The role modules under ``fedmech_flwr.api``, each a public face with its own ``__all__``."""

__all__ = [
    # errors, and what every check(params, cfg, data, where) receives
    "ConfigError", "DataInfo", "ExperimentConfig",
    # what a plug-in records
    "Metric", "Outputs",
    # seeds: a named stream of the run's seed, never the process-wide generators
    "numpy_rng", "seed_for", "torch_generator",
]


def __getattr__(name: str) -> Any:
    """A name this module had before it was split by role, for one release, with a warning
    naming its new place (``fedmech_flwr.api._deprecated``). Its submodules are not looked
    up here: ``from fedmech_flwr.api import client`` asks for them before importing them."""
    if name.startswith("_") or name in FACES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("fedmech_flwr.api._deprecated").resolve(name, __name__)
