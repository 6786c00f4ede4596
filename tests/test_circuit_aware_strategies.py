"""Circuit-aware aggregation with mocked replies against known answers: matched_avg
(a permuted copy is matched back, permutations keep the function, identical clients and
the identity control are FedAvg) and circuit_masked_avg (every channel in every circuit
is FedAvg, hand-built circuits give hand-computed per-channel averages, the random
control keeps the set sizes); and the checks both make before a run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedmech_flwr.builtin.strategies.circuit_masked import CircuitMaskedConfig, channel_weights, check_circuit_masked_avg, circuit_channels
from fedmech_flwr.builtin.strategies.matched_avg import MatchedAvgConfig, check_matched_avg, permute
from fedmech_flwr.contracts.hooks import encode_results
from fedmech_flwr.contracts.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.contracts.wire import REPORT_KEY
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, weighted_mean
from fedmech_flwr.learning.masks import pack_masks
from fedmech_flwr.models import build_model, wrap_module

EXAMPLES = [10, 30, 60]
SHAPE = {"in_channels": 1, "num_classes": 3, "image_size": 16}


def chain_cnn() -> nn.Module:
    """A user's CNN that is one chain of layers (BatchNorm, a flatten into a linear layer,
    LayerNorm), wrapped: channel groups read off its graph."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(96, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


MODELS = {
    "simple_cnn": lambda: build_model("simple_cnn", {"channels": [4, 6, 8]}, **SHAPE),
    "resnet10": lambda: build_model("resnet10", {"widths": [4, 6, 6, 8], "stem": "cifar"}, **SHAPE),
    "resnet10-imagenet": lambda: build_model("resnet10", {"widths": [4, 4, 6, 8]}, **SHAPE),
    "wrapped_chain": lambda: wrap_module(chain_cnn(), input_shape=(1, 16, 16)),
}


def make_model(kind: str):
    return MODELS[kind]().eval()


def random_arrays(kind: str, seed: int) -> NamedArrays:
    """A model's arrays with every float entry random (norm layers' statistics too, so a
    permutation that forgets them shows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, value in model_arrays(make_model(kind)).items():
        if not np.issubdtype(value.dtype, np.floating):
            out[key] = value
        elif key.endswith("running_var"):
            out[key] = rng.uniform(0.5, 2.0, value.shape).astype(value.dtype)
        else:
            out[key] = rng.normal(scale=0.5, size=value.shape).astype(value.dtype)
    return out


def random_perms(kind: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {g.name: rng.permutation(g.size) for g in make_model(kind).permutation_groups()}


def logits(kind: str, arrays: NamedArrays, x: torch.Tensor) -> np.ndarray:
    model = make_model(kind)
    load_model_arrays(model, arrays)
    with torch.no_grad():
        return model(x).double().numpy()


def context(kind: str, initial: NamedArrays, audit: torch.Tensor | None = None) -> StrategyContext:
    def build(arrays: NamedArrays):
        model = make_model(kind)
        load_model_arrays(model, arrays)
        return model

    held_out = None if audit is None else (audit, torch.zeros(len(audit)))
    return StrategyContext(num_classes=3, num_rounds=5, seed=0, round_timeout_s=60.0, initial=initial,
                           build_model=build, audit=held_out, num_clients=3)


def images(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


def aggregate(name: str, params, ctx: StrategyContext, msgs) -> tuple[NamedArrays, dict]:
    arrays, metrics = STRATEGIES.get(name).factory(params, ctx).aggregate_train(1, msgs)
    return from_record(arrays), dict(metrics)


# --- matched_avg -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", MODELS)
def test_a_permutation_of_every_group_keeps_the_function(kind):
    arrays = random_arrays(kind, 0)
    groups = make_model(kind).permutation_groups()
    shuffled = permute(arrays, groups, random_perms(kind, 1))
    assert any(not np.array_equal(shuffled[k], arrays[k]) for k in arrays)
    x = images()
    np.testing.assert_allclose(logits(kind, shuffled, x), logits(kind, arrays, x), rtol=0, atol=1e-4)


def test_resnet_channels_tied_by_a_skip_connection_share_a_group():
    names = [g.name for g in make_model("resnet10-imagenet").permutation_groups()]
    # layer1 keeps the identity shortcut (stem + conv2 added); layers 2-4 downsample (conv2 + shortcut conv added)
    assert names == ["layer1.conv1", "stem+layer1.conv2", "layer2.conv1", "layer2.conv2+layer2.downsample",
                     "layer3.conv1", "layer3.conv2+layer3.downsample", "layer4.conv1", "layer4.conv2+layer4.downsample"]
    groups = make_model("resnet10").permutation_groups()
    channels = sorted(key for g in groups for key in g.rows)
    assert len(channels) == len(set(channels))  # every producing array in exactly one group


@pytest.mark.parametrize("similarity", ["weights", "activations"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_model_and_its_permuted_copy_average_back_to_the_model(kind, similarity, messages):
    original = random_arrays(kind, 0)
    perms = random_perms(kind, 1)
    copy = permute(original, make_model(kind).permutation_groups(), perms)
    ctx = context(kind, original, images(128, 2))
    got, metrics = aggregate("matched_avg", MatchedAvgConfig(similarity=similarity), ctx,
                             [messages.train(1000, original, 10), messages.train(1001, copy, 30)])
    for key, value in original.items():
        np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6, err_msg=key)
    for name, perm in perms.items():
        assert metrics[f"moved/{name}"] == int((perm != np.arange(len(perm))).sum())
        assert metrics[f"gain/{name}"] > 0 or metrics[f"moved/{name}"] == 0


@pytest.mark.parametrize("kind", ["simple_cnn", "resnet10", "wrapped_chain"])
def test_matching_leaves_each_clients_function_unchanged(kind, messages, monkeypatch):
    import fedmech_flwr.builtin.strategies.matched_avg as matched

    reference, client = random_arrays(kind, 0), random_arrays(kind, 5)
    groups = make_model(kind).permutation_groups()
    perms, _ = matched.weight_matching(reference, client, groups, 0.0)
    assert any((p != np.arange(len(p))).any() for p in perms.values())  # unrelated models: channels move
    x = images()
    np.testing.assert_allclose(logits(kind, permute(client, groups, perms), x), logits(kind, client, x), rtol=0, atol=1e-4)


def test_identical_clients_give_fedavgs_result_exactly(messages):
    start = random_arrays("resnet10", 0)
    trained = {k: (v + 0.01 * np.ones_like(v)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in start.items()}
    msgs = [messages.train(1000 + i, trained, n) for i, n in enumerate(EXAMPLES)]
    got, metrics = aggregate("matched_avg", MatchedAvgConfig(), context("resnet10", start), msgs)
    fedavg = weighted_mean([trained] * 3, EXAMPLES)
    for key in fedavg:
        np.testing.assert_array_equal(got[key], fedavg[key])
    assert all(v == 0 for k, v in metrics.items() if k.startswith("moved/"))
    assert metrics["aggregate-seconds"] > 0  # the server's time, next to FedAvg's


def test_identity_below_a_large_threshold_is_fedavg_and_still_reports_the_gain(messages):
    original = random_arrays("simple_cnn", 0)
    models = [original, permute(original, make_model("simple_cnn").permutation_groups(), random_perms("simple_cnn", 1)),
              random_arrays("simple_cnn", 2)]
    msgs = [messages.train(1000 + i, m, n) for i, (m, n) in enumerate(zip(models, EXAMPLES))]
    got, metrics = aggregate("matched_avg", MatchedAvgConfig(identity_below=3.0), context("simple_cnn", original), msgs)
    fedavg = weighted_mean(models, EXAMPLES)
    for key in fedavg:
        np.testing.assert_array_equal(got[key], fedavg[key])
    assert all(v == 0 for k, v in metrics.items() if k.startswith("moved/"))
    assert all(v > 0 for k, v in metrics.items() if k.startswith("gain/"))


def test_only_the_named_layers_are_matched(messages):
    original = random_arrays("simple_cnn", 0)
    perms = random_perms("simple_cnn", 1)
    groups = make_model("simple_cnn").permutation_groups()
    copy = permute(original, groups, perms)
    got, metrics = aggregate("matched_avg", MatchedAvgConfig(layers=["conv1"]), context("simple_cnn", original),
                             [messages.train(1000, original, 1), messages.train(1001, copy, 1)])
    assert sorted(k for k in metrics if k.startswith("moved/")) == ["moved/conv1"]
    # conv1 is matched back; conv2 and conv3 stay where the copy has them, so their average differs
    aligned = permute(copy, groups, {"conv1": np.argsort(perms["conv1"]), "conv2": np.arange(6), "conv3": np.arange(8)})
    np.testing.assert_allclose(got["conv1.weight"], original["conv1.weight"], atol=1e-6)
    np.testing.assert_allclose(got["conv3.weight"], (original["conv3.weight"] + aligned["conv3.weight"]) / 2, atol=1e-6)


def test_largest_client_is_the_reference_when_asked(messages):
    original = random_arrays("simple_cnn", 0)
    copy = permute(original, make_model("simple_cnn").permutation_groups(), random_perms("simple_cnn", 1))
    got, _ = aggregate("matched_avg", MatchedAvgConfig(reference="largest_client"), context("simple_cnn", original),
                       [messages.train(1000, original, 10), messages.train(1001, copy, 30)])
    for key, value in copy.items():  # the copy has more examples: the original is matched onto it
        np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6)


def data_info(audit_per_class: int = 0) -> DataInfo:
    return DataInfo(torch.arange(40) % 4, 20, 4, (1, 12, 12), audit_per_class)


def test_matched_avg_checks_its_layers_and_the_audit_set(make_cfg):
    cfg = make_cfg()
    with pytest.raises(ConfigError, match=r"layers must name channel groups of model 'simple_cnn' \(conv1, conv2\)") as info:
        check_matched_avg(MatchedAvgConfig(layers=["conv9"]), cfg, data_info(), "x.yaml: strategy")
    assert info.value.where == "x.yaml: strategy.layers"
    with pytest.raises(ConfigError, match="data.audit_per_class is 0"):
        check_matched_avg(MatchedAvgConfig(similarity="activations"), cfg, data_info(), "strategy")
    check_matched_avg(MatchedAvgConfig(similarity="activations", layers=["conv2"]), cfg, data_info(10), "strategy")


def test_matched_avg_refuses_a_wrapped_module_with_skip_connections_and_says_why(make_cfg):
    cfg = make_cfg("model={name: torchvision, arch: resnet18}")
    with pytest.raises(ConfigError, match="model 'torchvision' does not give: a wrapped module gives channel groups "
                                          r"\(permutation_groups\) only for a chain of layers") as info:
        check_matched_avg(MatchedAvgConfig(), cfg, data_info(), "x.yaml: strategy")
    assert info.value.where == "x.yaml: strategy"
    assert "'add' reads 'body.layer1.0.bn2', 'body.maxpool'" in info.value.message  # layer1.0's skip connection


@pytest.mark.parametrize(("module", "why"), [
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(784, 3)),
     "'body.1' \\(GroupNorm\\) does not normalise each of 4 channels apart"),
    (nn.Sequential(nn.Conv2d(1, 4, 3, groups=1), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(576, 3)),
     "'body.1' is a grouped convolution"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.Softmax(1), nn.Flatten(), nn.Linear(784, 3)),
     "'body.1' \\(Softmax\\) is not known to keep channels apart"),
])
def test_a_wrapped_module_that_is_not_a_plain_chain_gives_no_channel_groups(module, why):
    with pytest.raises(NotImplementedError, match=why):
        wrap_module(module, input_shape=(1, 16, 16)).permutation_groups()


# --- circuit_masked_avg ------------------------------------------------------------------

LAYERS = {"conv1": 4, "conv2": 6, "conv3": 8}


def circuits_reply(messages, partition_id: int, arrays: NamedArrays, n: int, masks: dict[int, dict[str, np.ndarray]]):
    """A train reply carrying the circuits diagnostic's client-side result, as the ClientApp sends it."""
    msg = messages.train(1000 + partition_id, arrays, n)
    report = msg.content.config_records[REPORT_KEY]
    for key, value in encode_results({"circuits": {"held": sorted(masks), "seconds": 0.1, "masks": pack_masks(masks)}}).items():
        report[key] = value
    return msg


def mask(layer_channels: dict[str, list[int]]) -> dict[str, np.ndarray]:
    out = {layer: np.zeros(size, bool) for layer, size in LAYERS.items()}
    for layer, channels in layer_channels.items():
        out[layer][channels] = True
    return out


def test_circuit_channels_are_the_union_over_the_clients_classes():
    packed = pack_masks({0: mask({"conv1": [0], "conv3": [7]}), 2: mask({"conv1": [0, 2]})})
    got = circuit_channels(packed, LAYERS)
    assert {k: np.flatnonzero(v).tolist() for k, v in got.items()} == {"conv1": [0, 2], "conv2": [], "conv3": [7]}
    assert not any(v.any() for v in circuit_channels(pack_masks({}), LAYERS).values())


def test_circuits_that_hold_every_channel_give_fedavg(messages):
    models = [random_arrays("simple_cnn", i) for i in range(3)]
    everything = {0: mask({layer: list(range(size)) for layer, size in LAYERS.items()})}
    msgs = [circuits_reply(messages, i, models[i], EXAMPLES[i], everything) for i in range(3)]
    got, metrics = aggregate("circuit_masked_avg", CircuitMaskedConfig(), context("simple_cnn", models[0]), msgs)
    fedavg = weighted_mean(models, EXAMPLES)
    for key in fedavg:
        np.testing.assert_allclose(got[key], fedavg[key], rtol=0, atol=1e-6)
    assert metrics["clients/conv1"] == 3.0 and metrics["unused/conv3"] == 0


def test_hand_built_circuits_give_hand_computed_channel_averages(messages):
    models = [random_arrays("simple_cnn", i) for i in range(3)]
    circuits = [
        {0: mask({"conv1": [0, 1]}), 1: mask({"conv1": [1], "conv2": [5]})},  # client 0: conv1 {0, 1}, conv2 {5}
        {2: mask({"conv1": [1, 2]})},                                          # client 1: conv1 {1, 2}
        {},                                                                    # client 2 holds no class
    ]
    msgs = [circuits_reply(messages, i, models[i], EXAMPLES[i], circuits[i]) for i in range(3)]
    got, metrics = aggregate("circuit_masked_avg", CircuitMaskedConfig(), context("simple_cnn", models[0]), msgs)
    w = {k: [m[k].astype(np.float64) for m in models] for k in ("conv1.weight", "conv1.bias", "conv2.bias", "conv3.bias")}
    # conv1: channel 0 only client 0; channel 1 clients 0 and 1 (10:30); channel 2 only client 1;
    # channel 3 nobody, so all three (10:30:60)
    expected = [w["conv1.weight"][0][0], (10 * w["conv1.weight"][0][1] + 30 * w["conv1.weight"][1][1]) / 40,
                w["conv1.weight"][1][2], (10 * w["conv1.weight"][0][3] + 30 * w["conv1.weight"][1][3]
                                          + 60 * w["conv1.weight"][2][3]) / 100]
    np.testing.assert_allclose(got["conv1.weight"], np.stack(expected), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["conv1.bias"][:3], [w["conv1.bias"][0][0], (10 * w["conv1.bias"][0][1] + 30 * w["conv1.bias"][1][1]) / 40,
                                                       w["conv1.bias"][1][2]], atol=1e-6)
    np.testing.assert_allclose(got["conv2.bias"][5], w["conv2.bias"][0][5], atol=1e-6)  # only client 0 uses it
    fedavg = weighted_mean(models, EXAMPLES)
    np.testing.assert_allclose(got["conv2.bias"][:5], fedavg["conv2.bias"][:5], atol=1e-6)  # unused: FedAvg
    for key in ("conv3.weight", "conv3.bias", "head.weight", "head.bias"):
        np.testing.assert_array_equal(got[key], fedavg[key])
    assert metrics["clients/conv1"] == pytest.approx((1 + 2 + 1) / 3)
    assert metrics["unused/conv1"] == 1 and metrics["unused/conv2"] == 5 and metrics["unused/conv3"] == 8


def test_channel_weights_fall_back_to_every_client_where_no_set_holds_the_channel():
    sets = [np.array([True, False, False]), np.array([True, True, False])]
    np.testing.assert_array_equal(channel_weights(sets, [1.0, 3.0]), [[1, 0, 1], [3, 3, 3]])


def test_the_random_control_keeps_each_clients_set_sizes(messages):
    models = [random_arrays("resnet10", i) for i in range(3)]
    layers = make_model("resnet10").gated_layers()
    rng = np.random.default_rng(0)
    circuits = [{0: {k: rng.random(n) < 0.3 for k, n in layers.items()}} for _ in range(3)]
    msgs = [circuits_reply(messages, i, models[i], EXAMPLES[i], circuits[i]) for i in range(3)]
    ctx = context("resnet10", models[0])
    strategy = STRATEGIES.get("circuit_masked_avg").factory(CircuitMaskedConfig(channels="random"), ctx)
    contents = [m.content for m in msgs]
    random_sets = strategy.channel_sets(1, contents)
    for own, drawn in zip(circuits, random_sets):
        assert {k: int(v.sum()) for k, v in drawn.items()} == {k: int(v.sum()) for k, v in own[0].items()}
    assert any(not np.array_equal(drawn[k], own[0][k]) for own, drawn in zip(circuits, random_sets) for k in layers)
    again = strategy.channel_sets(1, contents)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(random_sets, again) for k in layers)  # seeded
    other_round = strategy.channel_sets(2, contents)
    assert any(not np.array_equal(a[k], b[k]) for a, b in zip(random_sets, other_round) for k in layers)
    got, _ = aggregate("circuit_masked_avg", CircuitMaskedConfig(channels="random"), ctx, msgs)
    assert not np.allclose(got["layer1.conv1.weight"], weighted_mean(models, EXAMPLES)["layer1.conv1.weight"])


@pytest.mark.parametrize("diagnostics", ["[]", "[{name: circuits, every: 2}]"])
def test_circuit_masked_avg_needs_the_circuits_diagnostic_every_round(make_cfg, diagnostics):
    with pytest.raises(ConfigError, match=r"the circuits diagnostic must run every round.*add \{name: circuits, every: 1\}") as info:
        make_cfg("strategy={name: circuit_masked_avg}", f"diagnostics={diagnostics}")  # loading checks, before Flower starts
    assert info.value.where.endswith("smoke.yaml: strategy")
    check_circuit_masked_avg(CircuitMaskedConfig(), make_cfg("diagnostics=[{name: circuits, every: 1}]"), data_info(), "s")
