"""The contract checks (``fedmech_flwr.contracts.conformance``) on every built-in client, strategy and
diagnostic (the models': ``test_models.py``), and each check failing, with its message, on
a planted broken plug-in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.client import CLIENTS, FedMechClient, check_client
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, check_diagnostic
from fedmech_flwr.api.model import MODELS, FedMechModel, check_model
from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, WeightedFedAvg, check_strategy
from fedmech_flwr.contracts import plugins

plugins.load()

STRATEGY_CASES = {
    "fedavg_head_realign": ({"head_samples": 12}, ()),  # the checks' audit set: 8 images a class
    "ccvr": ({"ccvr_virtual_per_class": 20}, ()),
    "circuit_masked_avg": (None, ("circuits",)),  # reads the clients' local circuits
}
"""Built-in strategies' parameters and the diagnostics their clients must send (the
others: defaults, none)."""
DIAGNOSTIC_PARAMS = {
    "misalignment": {"head_samples": 12},
    "neural_collapse": {"clients": True},  # every declared metric recorded
    "usae": {"layer": "conv2", "max_images": 100,
             "usae": {"expansion": 2, "k": 4, "epochs": 2, "batch_size": 256, "min_steps": 0}},
}


@pytest.mark.parametrize("name", CLIENTS.names())
def test_every_builtin_client_passes_check_client(name):
    check_client(name)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_builtin_strategy_passes_check_strategy(name):
    params, diagnostics = STRATEGY_CASES.get(name, (None, ()))
    check_strategy(name, params, diagnostics=diagnostics)


@pytest.mark.parametrize("name", DIAGNOSTICS.names())
def test_every_builtin_diagnostic_passes_check_diagnostic(name):
    check_diagnostic(name, DIAGNOSTIC_PARAMS.get(name))


# --- planted broken plug-ins -----------------------------------------------------------------

@pytest.fixture
def planted(monkeypatch):
    """``planted(REGISTRY, name, factory, **options)`` registers a broken plug-in for one test."""
    def plant(registry, name, factory, **options):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        registry.register(name, **options)(factory)
    return plant


class HeadlessMLP(FedMechModel):
    """Its logits are twice its head's: not forward_head(forward_features(x))."""

    def __init__(self, *, in_channels, num_classes, image_size):
        super().__init__()
        self.fc1 = nn.Linear(in_channels * image_size**2, 6)
        self.head = nn.Linear(6, num_classes)
        self._gates = {"fc1": ("fc1", "fc1")}
        self.num_classes, self.feature_dim = num_classes, 6

    def forward_features(self, x):
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x):
        return self.head(self.forward_features(x)) * 2


def test_check_model_fails_a_model_whose_logits_are_not_its_head_of_its_features(planted):
    planted(MODELS, "lab_headless", lambda cfg, **shape: HeadlessMLP(**shape))
    with pytest.raises(AssertionError, match=r"^model 'lab_headless' gives other logits than "
                                             r"forward_head\(forward_features\(x\)\): compute the forward"):
        check_model("lab_headless", in_channels=1, image_size=4)


def test_check_model_fails_a_model_built_from_another_generator(planted):
    planted(MODELS, "lab_unseeded", lambda cfg, **shape: _unseeded(**shape))
    with pytest.raises(AssertionError, match="^model 'lab_unseeded' differs between two builds from seed 0: draw"):
        check_model("lab_unseeded", in_channels=1, image_size=4)


def _unseeded(**shape):
    model = HeadlessMLP(**shape)
    model.forward = lambda x: model.head(model.forward_features(x))
    with torch.no_grad():
        model.fc1.weight.add_(torch.from_numpy(np.random.default_rng().normal(size=model.fc1.weight.shape)).float())
    return model


class InPlaceClient(FedMechClient):
    """Adds 1 to the first array it is given."""

    def fit(self, parameters, config):
        parameters[0] += 1
        return super().fit(parameters, config)


class HalfClient(FedMechClient):
    """Returns its weights in float16."""

    def fit(self, parameters, config):
        weights, n, metrics = super().fit(parameters, config)
        return [w.astype(np.float16) for w in weights], n, metrics


@pytest.mark.parametrize(("cls", "message"), [
    (InPlaceClient, "^client 'lab_broken' changed the arrays fit was given: copy them before changing them$"),
    (HalfClient, "^client 'lab_broken' returned weights 'conv1.weight' of shape .* and dtype float16, not .* and "
                 "float32: keep each array's shape and dtype"),
])
def test_check_client_fails_a_client_that_breaks_the_contract(planted, cls, message):
    planted(CLIENTS, "lab_broken", cls)
    with pytest.raises(AssertionError, match=message):
        check_client("lab_broken")


class MutatingFedAvg(WeightedFedAvg):
    """Overwrites the first reply's arrays with the second's."""

    def average(self, server_round, contents, models, weights):
        contents[0]["arrays"] = contents[1]["arrays"]
        return super().average(server_round, contents, models, weights)


class NoisyFedAvg(WeightedFedAvg):
    """Adds noise from the process-wide generator."""

    def average(self, server_round, contents, models, weights):
        mean, metrics = super().average(server_round, contents, models, weights)
        return {k: (v + np.random.default_rng().normal(size=v.shape)).astype(v.dtype) for k, v in mean.items()}, metrics


class ForgetfulFedAvg(WeightedFedAvg):
    """Saves a state it does not restore."""

    def state_arrays(self):
        return {"rounds": np.array([len(self.sent)])}

    def load_state_arrays(self, arrays):
        pass


@pytest.mark.parametrize(("cls", "message"), [
    (MutatingFedAvg, "^strategy 'lab_broken' changed the arrays of the replies or of the model it sent: copy them"),
    (NoisyFedAvg, "^strategy 'lab_broken' aggregated the same replies otherwise in a second run from seed 0: draw"),
    (ForgetfulFedAvg, "^strategy 'lab_broken' gives other state_arrays after load_state_arrays of its own: restore"),
])
def test_check_strategy_fails_a_strategy_that_breaks_the_contract(planted, cls, message):
    planted(STRATEGIES, "lab_broken", lambda params, ctx: cls(**OFFERED_NODES_ONLY))
    with pytest.raises(AssertionError, match=message):
        check_strategy("lab_broken")


OUTPUTS = Outputs("Lab", {"norm": Metric("norm", ("norm",), "L2", 2), "gap": Metric("gap", ("gap", "mean"), "", 2)})


class Meddling(Diagnostic):
    """Zeroes the global model."""

    def server_side(self, state):
        for value in state.global_arrays.values():
            value[...] = 0
        return DiagnosticResult({"norm": 0.0, "gap": None})


class Undeclared(Diagnostic):
    """Records ``gap`` without its declared ``mean``."""

    def server_side(self, state):
        return DiagnosticResult({"norm": 1.0, "gap": {"max": 1.0}})


class NotANumber(Diagnostic):
    """Records NaN where it means undefined."""

    def server_side(self, state):
        return DiagnosticResult({"norm": float("nan"), "gap": None})


@pytest.mark.parametrize(("cls", "message"), [
    (Meddling, "^diagnostic 'lab_broken' changed a model it was given: copy arrays before changing them; only observe$"),
    (Undeclared, r"^diagnostic 'lab_broken' recorded 'gap' without 'gap.mean', which its Outputs declare as 'gap'"),
    (NotANumber, "^diagnostic 'lab_broken' recorded nan as 'norm': record a finite number, or None where"),
])
def test_check_diagnostic_fails_a_diagnostic_that_breaks_the_contract(planted, cls, message):
    planted(DIAGNOSTICS, "lab_broken", cls, outputs=OUTPUTS)
    with pytest.raises(AssertionError, match=message):
        check_diagnostic("lab_broken")
