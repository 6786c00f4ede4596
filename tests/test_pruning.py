"""Magnitude pruning hits its per-layer targets without changing the state_dict layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.typed import parse_dataclass
from fedmech_flwr.learning.pruning import (
    MagnitudePruner,
    PruningConfig,
    layer_sparsity,
    overall_sparsity,
    prune_to,
)
from fedmech_flwr.models import build_model


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(
        "simple_cnn", {"channels": [32, 64, 64]}, in_channels=3, num_classes=10, image_size=16
    )


def train(model, pruner, steps: int, seed: int = 0) -> None:
    """A few SGD steps on random data, pruning after each."""
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        pruner.step(i)


def assert_at_target(model, target, names):
    weights = model.prunable_parameters()
    sparsity = layer_sparsity(model)
    for name in names:
        assert abs(sparsity[name] - target) <= 1 / weights[name].numel(), name


@pytest.mark.parametrize("target", [0.9, 0.999])
def test_pruner_reaches_target_per_layer_and_spares_head(target):
    model = make_model()
    cfg = PruningConfig(target_sparsity=target, ramp_fraction=0.5)
    pruner = MagnitudePruner(model, cfg, total_steps=6)
    keys = list(model.state_dict())
    train(model, pruner, steps=5)
    head_before = model.head.weight.detach().clone()
    pruner.step(5)
    body = [n for n in model.prunable_parameters() if n != "head.weight"]
    assert_at_target(model, target, body)
    assert torch.equal(model.head.weight, head_before)
    assert list(model.state_dict()) == keys
    assert overall_sparsity(model, include_head=False) >= target - 1e-3


def test_include_head_prunes_head():
    model = make_model()
    pruner = MagnitudePruner(model, PruningConfig(target_sparsity=0.9, include_head=True), 4)
    train(model, pruner, steps=4)
    assert_at_target(model, 0.9, model.prunable_parameters())


def test_state_dict_keys_match_across_independently_pruned_models():
    a, b, dense = make_model(0), make_model(1), make_model(2)
    train(a, MagnitudePruner(a, PruningConfig(target_sparsity=0.9), 4), steps=4, seed=0)
    train(b, MagnitudePruner(b, PruningConfig(target_sparsity=0.99), 4), steps=4, seed=1)
    shapes = {k: v.shape for k, v in dense.state_dict().items()}
    assert {k: v.shape for k, v in a.state_dict().items()} == shapes
    assert {k: v.shape for k, v in b.state_dict().items()} == shapes


def test_min_weights_per_filter_keeps_every_filter_alive():
    model = make_model()
    cfg = PruningConfig(target_sparsity=0.999, min_weights_per_filter=2)
    prune_to(model, 0.999, cfg)
    for name, weight in model.prunable_parameters().items():
        if name != "head.weight":
            nonzero_per_filter = (weight.reshape(weight.shape[0], -1) != 0).sum(1)
            assert (nonzero_per_filter >= 2).all(), name
    conv3 = model.conv3.weight  # 64 filters * 2 = 128 kept > budget of 37: exactly 2 each
    assert (conv3.reshape(64, -1) != 0).sum().item() == 128


def test_min_weights_per_filter_counts_towards_budget():
    model = make_model()
    prune_to(model, 0.9, PruningConfig(min_weights_per_filter=1))
    assert_at_target(model, 0.9, ["conv1.weight", "conv2.weight", "conv3.weight"])


def test_dense_mode_changes_nothing():
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruner = MagnitudePruner(model, PruningConfig(mode="dense"), total_steps=4)
    for i in range(4):
        pruner.step(i)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("schedule", ["cubic", "linear"])
def test_schedule(schedule):
    cfg = PruningConfig(target_sparsity=0.99, ramp_fraction=0.5, schedule=schedule)
    pruner = MagnitudePruner(make_model(), cfg, total_steps=100, start_sparsity=0.5)
    values = [pruner.sparsity_at(s) for s in range(101)]
    assert values[0] == 0.5
    assert values[50] == values[100] == 0.99
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert 0.5 < values[25] < 0.99


def test_zero_ramp_prunes_to_target_at_first_step():
    model = make_model()
    pruner = MagnitudePruner(model, PruningConfig(target_sparsity=0.9, ramp_fraction=0.0), 10)
    assert pruner.sparsity_at(0) == 0.9
    pruner.step(0)
    assert_at_target(model, 0.9, ["conv1.weight", "conv2.weight", "conv3.weight"])


def test_prune_to_hits_target():
    model = make_model()
    prune_to(model, 0.95, PruningConfig(include_head=True))
    assert_at_target(model, 0.95, model.prunable_parameters())
    assert overall_sparsity(model, include_head=True) == pytest.approx(0.95, abs=1e-3)


def test_layer_sparsity_counts_exact_zeros():
    model = make_model()
    with torch.no_grad():
        model.conv1.weight.copy_(torch.arange(model.conv1.weight.numel()).view(32, 3, 3, 3))
        model.conv1.weight[0, 0, 0, 1:] = 0.0  # index 0 is already zero: 3 zeros
    assert layer_sparsity(model)["conv1.weight"] == 3 / (32 * 3 * 3 * 3)
    assert set(layer_sparsity(model)) == set(model.prunable_parameters())


def test_config_validation():
    assert parse_dataclass(PruningConfig, {}, "pruning") == PruningConfig()
    with pytest.raises(ConfigError, match="target_sparsity must be <"):
        parse_dataclass(PruningConfig, {"target_sparsity": 1.0}, "pruning")
    with pytest.raises(ConfigError, match="choose one of"):
        parse_dataclass(PruningConfig, {"schedule": "exp"}, "pruning")
