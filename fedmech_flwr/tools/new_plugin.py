"""``fedmech new KIND NAME``: a start for your own plug-in, in your own folder.

Three files: ``NAME.py`` (a minimal registered plug-in of the kind, importing only
``fedmech_flwr.api`` and its role module, with the metrics it records declared in ``outputs=`` so that every
view shows them), ``test_NAME.py`` (its test in this project's style: a strategy aggregates
mocked client replies into a hand-computed result, a client's loss and a diagnostic's
metric are known answers; and the contract check of its kind, ``check_strategy`` ...
``check_model``) and ``NAME.yaml`` (the smoke
experiment using it through ``plugins: [NAME]``). Nothing is overwritten.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
from pathlib import Path
from string import Template

import yaml

from fedmech_flwr.artifacts.folder import APP_DIR
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.spec.config import PLUGIN_KEYS, plugin_registries, read_yaml

PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]*")
"""A plug-in's name: it names its module and its registered entry."""
SMOKE = APP_DIR / "experiments" / "smoke.yaml"

MODULES = {
    "strategy": '''"""$name: the coordinate-wise median of the clients' models (Yin et al. 2018,
arXiv:1803.01498), robust to a minority of outlying clients. A start for your own
aggregation rule: change ``average``.

The client must return its weights and ``num-examples``, as for FedAvg.
"""

from __future__ import annotations

import numpy as np
from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, StrategyContext, WeightedFedAvg


class $cls(WeightedFedAvg):
    """Flower's FedAvg with ``average`` replaced: each array is the element-wise median of
    the clients' arrays, in their dtype (the clients' weights are not used)."""

    def average(self, server_round, contents, models, weights):
        median = {k: np.median(np.stack([m[k] for m in models]), axis=0).astype(models[0][k].dtype)
                  for k in models[0]}
        return median, {}


@STRATEGIES.register("$name")
def $name(params, ctx: StrategyContext) -> $cls:
    return $cls(**OFFERED_NODES_ONLY)
''',
    "client": '''"""$name: local training with label smoothing (Szegedy et al. 2016, arXiv:1512.00567).
A start for your own client behaviour: change ``loss`` (or ``fit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from fedmech_flwr.api.client import CLIENTS, FedMechClient
from torch import nn


@dataclass
class ${cls}Config:
    smoothing: float = field(default=0.1, metadata={"ge": 0.0, "lt": 1.0})
    """Label smoothing of the local cross-entropy; 0 is the plain client."""


@CLIENTS.register("$name", ${cls}Config)
class $cls(FedMechClient):
    """Cross-entropy against labels smoothed towards the uniform distribution."""

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y, label_smoothing=self.params.smoothing)
''',
    "diagnostic": '''"""$name: the L2 norm of the global model's floating-point arrays after each round.
A start for your own diagnostic: change ``server_side`` (and add ``client_side`` for work
on the clients' data).
"""

from __future__ import annotations

import numpy as np
from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, RoundState

OUTPUTS = Outputs("$name", {
    "global_norm": Metric("L2 norm of the global model", ("global_norm",), "L2", 3),
}, curves=("global_norm",), headline=("global_norm",))
"""What it records, declared: the console's round line, ``fedmech status``, the report, the
CSV export and TensorBoard show these."""


@DIAGNOSTICS.register("$name", outputs=OUTPUTS)
class $cls(Diagnostic):
    """``global_norm``: sqrt of the sum of squares of every floating-point array of the
    aggregated model."""

    def server_side(self, state: RoundState) -> DiagnosticResult:
        arrays = [a for a in state.global_arrays.values() if np.issubdtype(a.dtype, np.floating)]
        return DiagnosticResult({"global_norm": float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64))
                                                                   for a in arrays)))})
''',
    "model": '''"""$name: a one-hidden-layer perceptron on the flattened image. A start for your own
model: keep the FedMechModel interface (features, head, gated layers) the diagnostics use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedmech_flwr.api.model import MODELS, FedMechModel
from torch import Tensor, nn


@dataclass
class ${cls}Config:
    hidden: int = field(default=64, metadata={"ge": 1})
    """Units of the hidden layer."""


class $cls(FedMechModel):
    """flatten, linear + ReLU (the gated layer ``fc1``), then the linear head."""

    def __init__(self, hidden: int, *, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_channels * image_size * image_size, hidden)
        self._gates = {"fc1": ("fc1", "fc1")}
        self.num_classes = num_classes
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def forward_features(self, x: Tensor) -> Tensor:
        return nn.functional.relu(self.fc1(x.flatten(1)))


@MODELS.register("$name", ${cls}Config)
def $name(cfg: ${cls}Config, *, in_channels: int, num_classes: int, image_size: int) -> $cls:
    return $cls(cfg.hidden, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
''',
}

TESTS = {
    "strategy": '''"""$name aggregates mocked client replies into the hand-computed median, and
honours the strategy contract."""

import numpy as np
from fedmech_flwr.api.strategy import STRATEGIES, check_strategy, from_record, train_replies

import $name  # noqa: F401  (registers it)


def test_aggregate_of_mocked_replies_is_the_hand_computed_median():
    models = [{"w": np.array([1.0, -4.0], np.float32), "steps": np.array(3)},
              {"w": np.array([2.0, 0.0], np.float32), "steps": np.array(5)},
              {"w": np.array([10.0, 5.0], np.float32), "steps": np.array(9)}]
    entry = STRATEGIES.get("$name")
    arrays, _ = entry.factory(entry.config_cls(), None).aggregate_train(1, train_replies(models, [10, 30, 60]))
    got = from_record(arrays)
    assert got["w"].dtype == np.float32 and got["w"].tolist() == [2.0, 0.0]  # not the weighted mean, [6.7, 2.6]
    assert got["steps"].dtype == models[0]["steps"].dtype and got["steps"] == 5


def test_contract():
    check_strategy("$name")
''',
    "client": '''"""$name's local loss against the hand-computed label-smoothed cross-entropy, and the
client contract."""

import math

import torch
from fedmech_flwr.api.client import CLIENTS, check_client

import $name  # noqa: F401  (registers it)


def loss(smoothing: float, logits: torch.Tensor, y: torch.Tensor) -> float:
    entry = CLIENTS.get("$name")
    client = entry.factory(entry.config_cls(smoothing=smoothing), model=None, data=None, train=None, pruning=None,
                           seed=0, partition_id=0)
    return float(client.loss(logits, y))


def test_loss_is_the_hand_computed_smoothed_cross_entropy():
    logits, y = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    log_z = math.log(math.exp(2.0) + 1.0)  # log-softmax: [2 - log_z, -log_z]
    assert math.isclose(loss(0.0, logits, y), log_z - 2.0, rel_tol=1e-6)
    smoothed = 0.8 * (log_z - 2.0) + 0.2 * ((log_z - 2.0) + log_z) / 2
    assert math.isclose(loss(0.2, logits, y), smoothed, rel_tol=1e-6)


def test_contract():
    check_client("$name")
''',
    "diagnostic": '''"""$name's metric on a known model, and the diagnostic contract."""

import numpy as np
import torch
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, RoundState, check_diagnostic

import $name  # noqa: F401  (registers it)


def test_global_norm_of_a_known_model():
    arrays = {"w": np.array([[3.0, 0.0]], np.float32), "b": np.array([4.0]), "steps": np.array(12)}
    state = RoundState(server_round=1, global_arrays=arrays, previous_global_arrays=arrays, clients={}, datasets={},
                       num_classes=2, build_model=None, device=torch.device("cpu"), seed=0)
    entry = DIAGNOSTICS.get("$name")
    result = entry.factory(entry.config_cls()).server_side(state)
    assert result.metrics == {"global_norm": 5.0}  # integer arrays (counters) left out


def test_contract():
    check_diagnostic("$name")
''',
    "model": '''"""$name honours the model contract the diagnostics rely on."""

import pytest
from fedmech_flwr.api.model import check_model

import $name  # noqa: F401  (registers it)


@pytest.mark.parametrize(("in_channels", "image_size"), [(1, 28), (3, 32)])
def test_contract(in_channels, image_size):
    check_model("$name", in_channels=in_channels, image_size=image_size)
''',
}


def check_name(kind: str, name: str) -> None:
    """Refuse a name that is not a lowercase identifier, is registered already, or is the
    name of a module Python can already import (the plug-in would shadow it, or not load)."""
    if not PLUGIN_NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ConfigError(f"'{name}' is not a plug-in name: use a lowercase Python identifier such as my_median "
                          "(it names the module and the registered entry)", "fedmech new")
    registry = plugin_registries()[kind]
    if name in registry:
        raise ConfigError(f"{kind} '{name}' is already registered by {registry.get(name).origin}; pick another name",
                          "fedmech new")
    if spec := importlib.util.find_spec(name):
        raise ConfigError(f"a module '{name}' already exists ({spec.origin}); a plug-in module of that name would "
                          "shadow it or be shadowed: pick another name", "fedmech new")


def experiment(kind: str, name: str) -> str:
    """The smoke experiment with ``name`` chosen for ``kind`` through ``plugins: [name]``."""
    raw = {"name": name, "plugins": [name], **{k: v for k, v in read_yaml(SMOKE).items() if k != "name"}}
    if kind == "diagnostic":
        raw["diagnostics"] = [{"name": name, "every": 1}]
    else:
        raw[PLUGIN_KEYS[kind]] = {"name": name}
    header = (f"# The smoke experiment with the {kind} '{name}' (a few seconds on a CPU). {name}.py must be\n"
              f"# importable: PYTHONPATH=<this folder> fedmech run {name}.yaml\n")
    return header + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)


def write_plugin(kind: str, name: str, folder: Path) -> list[Path]:
    """Write ``NAME.py``, ``test_NAME.py`` and ``NAME.yaml`` into ``folder``; refuse a bad
    name or any of them existing (nothing is written then)."""
    check_name(kind, name)
    cls = "".join(part.capitalize() for part in name.split("_"))
    texts = {folder / f"{name}.py": Template(MODULES[kind]).substitute(name=name, cls=cls),
             folder / f"test_{name}.py": Template(TESTS[kind]).substitute(name=name, cls=cls),
             folder / f"{name}.yaml": experiment(kind, name)}
    if existing := [str(path) for path in texts if path.exists()]:
        raise ConfigError(f"{', '.join(existing)} already exist(s); fedmech new never overwrites: move them, or "
                          "choose another name or --dir", "fedmech new")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        path.write_text(text)
    return list(texts)
