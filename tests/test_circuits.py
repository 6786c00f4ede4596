"""Circuit discovery, metrics, mask packing and ablation (diagnostics.circuits)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmech_flwr.builtin.diagnostics.circuits.ablation import ablate, ablation_report, channel_means, without_channels
from fedmech_flwr.builtin.diagnostics.circuits.diagnostic import Circuits, CircuitsConfig
from fedmech_flwr.builtin.diagnostics.circuits.discovery import discover_circuits, discover_one_class
from fedmech_flwr.builtin.diagnostics.circuits.gates import GateConfig, gated, ste_gate
from fedmech_flwr.builtin.diagnostics.circuits.metrics import PAPER_EMPTY_IOU, circuit_iou, circuit_size, is_empty, layer_iou
from fedmech_flwr.contracts.hooks import ClientUpdate, RoundState
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import model_arrays
from fedmech_flwr.learning.masks import pack_masks, unpack_masks
from fedmech_flwr.models import FedMechModel, build_model


class OneConv(FedMechModel):
    """Three classes, inputs ~ one-hot over 3 input channels; conv channel k reads input
    channel c and only it feeds logit c: class 0 <- channel 2, 1 <- 0, 2 <- 1. Channel 3
    responds to every input but the head ignores it."""

    CIRCUIT = {0: 2, 1: 0, 2: 1}

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, 3)
        self._gates = {"conv": ("conv", "conv")}
        self.num_classes, self.feature_dim = 3, 4
        with torch.no_grad():
            self.conv.weight.zero_()
            self.head.weight.zero_()
            for c, k in self.CIRCUIT.items():
                self.conv.weight[k, c] = 1.0
                self.head.weight[c, k] = 6.0
            self.conv.weight[3] = 1.0
            self.conv.bias.copy_(torch.tensor([-0.5, -0.5, -0.5, 0.0]))
            self.head.bias.zero_()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1)


class BiasOnly(OneConv):
    """OneConv whose head reads no channel for class 2 but has a bias towards it: classes 0
    and 1 are predicted through their channels, class 2 by the bias alone."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.head.weight.mul_(2.0)
            self.head.weight[2].zero_()
            self.head.bias.copy_(torch.tensor([0.0, 0.0, 3.0]))


def one_hot_data(n: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = F.one_hot(y, 3).float()[:, :, None, None].expand(-1, -1, 4, 4)
    return x + 0.1 * torch.randn(n, 3, 4, 4, generator=g), y


def state_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def channels(mask: dict[str, torch.Tensor], layer: str) -> list[int]:
    return torch.as_tensor(mask[layer]).nonzero().flatten().tolist()


# --- metrics -----------------------------------------------------------------------------


def test_iou_known_answers():
    a = {"l1": np.array([1, 1, 0, 0], bool), "l2": np.array([0, 0, 0], bool)}
    assert circuit_iou(a, a) == 1.0 and layer_iou(a, a) == {"l1": 1.0, "l2": None}  # l2: empty in both
    disjoint = {"l1": np.array([0, 0, 1, 1], bool), "l2": np.array([1, 0, 0], bool)}
    assert layer_iou(a, disjoint)["l1"] == 0.0 and circuit_iou(a, disjoint) == 0.0
    both_empty = {"l1": torch.zeros(4, dtype=torch.bool), "l2": torch.zeros(3, dtype=torch.bool)}
    assert circuit_iou(both_empty, both_empty) is None  # undefined, never a perfect score
    assert circuit_iou(both_empty, a) == 0.0  # an empty circuit against a non-empty one disagrees
    assert layer_iou(both_empty, a, empty_value=0.5)["l2"] == 0.5
    assert circuit_iou(both_empty, both_empty, empty_value=PAPER_EMPTY_IOU) == 1.0
    partial = {"l1": torch.tensor([True, False, True, False]), "l2": torch.tensor([False, False, False])}
    # l1: {0,1} vs {0,2} -> 1/3; l2 empty in both: left out, or 1.0 under the paper's convention
    assert layer_iou(a, partial)["l1"] == pytest.approx(1 / 3)
    assert circuit_iou(a, partial) == pytest.approx(1 / 3)
    assert circuit_iou(a, partial, PAPER_EMPTY_IOU) == pytest.approx((1 / 3 + 1.0) / 2)
    assert circuit_size(a) == {"l1": 2, "l2": 0}
    assert not is_empty(a) and is_empty(both_empty)
    with pytest.raises(ValueError, match="different layers"):
        circuit_iou(a, {"l1": a["l1"]})


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    sizes = {"conv1": 5, "conv2": 13, "fc": 3}
    masks = {c: {n: torch.from_numpy(rng.random(s) < 0.5) for n, s in sizes.items()} for c in (0, 3, 7)}
    data = pack_masks(masks)
    assert isinstance(data, bytes) and len(data) < 100
    out = unpack_masks(data, sizes)
    assert list(out) == [0, 3, 7]
    for c in masks:
        assert list(out[c]) == list(sizes)
        for n in sizes:
            assert out[c][n].dtype == bool and np.array_equal(out[c][n], masks[c][n].numpy())
    assert unpack_masks(pack_masks({})) == {}
    with pytest.raises(ValueError, match="packed for layers"):
        unpack_masks(data, {"conv1": 5})


# --- gates ---------------------------------------------------------------------------------


def test_ste_gate_is_hard_forward_with_sigmoid_gradient():
    g = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    out = ste_gate(g)
    assert out.tolist() == [0.0, 1.0, 1.0]
    out.sum().backward()
    s = torch.sigmoid(g.detach())
    assert torch.allclose(g.grad, s * (1 - s))


def test_gated_context_removes_hooks_even_on_error():
    model = OneConv()
    x, _ = one_hot_data(6)
    with gated(model, {"conv": torch.zeros(6, 4)}):
        assert torch.allclose(model(x), model.head.bias.expand(6, -1))
    assert no_hooks(model)
    with pytest.raises(RuntimeError, match="boom"), gated(model, {"conv": torch.ones(6, 4)}):
        raise RuntimeError("boom")
    assert no_hooks(model)


# --- discovery -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ste", "hard_concrete"])
def test_discovery_finds_the_hand_built_circuit(kind):
    model = OneConv()
    x, y = one_hot_data()
    assert (model(x).argmax(1) == y).all()
    cfg = GateConfig(kind=kind, lam=0.05, steps=100, batch_size=16)
    masks = discover_circuits(model, x, y, [0, 1, 2], cfg, torch.Generator().manual_seed(1))
    for c, k in OneConv.CIRCUIT.items():
        assert channels(masks[c], "conv") == [k], (kind, c)
        assert masks[c]["conv"].dtype == torch.bool


def test_vectorised_equals_class_by_class(trained_cnn):
    model, data = trained_cnn
    x, y = data.x_train, data.y_train
    for kind in ("ste", "hard_concrete"):
        cfg = GateConfig(kind=kind, lam=0.05, lr=0.2, steps=25, batch_size=32)  # 8 per class
        together = discover_circuits(model, x, y, [0, 1, 2, 3], cfg, torch.Generator().manual_seed(5))
        chunked_cfg = dataclasses.replace(cfg, max_batch=16)  # two classes per forward pass
        chunked = discover_circuits(model, x, y, [0, 1, 2, 3], chunked_cfg, torch.Generator().manual_seed(5))
        one_cfg = dataclasses.replace(cfg, batch_size=8)  # a class alone gets the same 8 samples
        sizes = []
        for c in range(4):
            alone = discover_one_class(model, x, y, c, one_cfg, torch.Generator().manual_seed(5))
            for layer in model.gated_layers():
                assert torch.equal(alone[layer], together[c][layer]), (kind, c, layer)
                assert torch.equal(alone[layer], chunked[c][layer]), (kind, c, layer)
            sizes.append(sum(circuit_size(alone).values()))
        assert 0 < sum(sizes) < 4 * 12, sizes  # the masks are not trivially all-on/off


def test_discovery_leaves_model_untouched(trained_cnn):
    model, data = trained_cnn
    model.train()
    model.conv1.weight.requires_grad_(False)
    before = state_hash(model)
    cfg = GateConfig(steps=3, batch_size=4)
    masks = discover_circuits(model, data.x_train, data.y_train, [1, 2], cfg, torch.Generator().manual_seed(0))
    assert set(masks) == {1, 2} and list(masks[1]) == ["conv1", "conv2"]
    assert state_hash(model) == before
    assert no_hooks(model) and model.training
    assert [p.requires_grad for p in model.parameters()] == [False, True, True, True, True, True]
    assert all(p.grad is None for p in model.parameters())
    model.conv1.weight.requires_grad_(True)
    model.eval()
    only = discover_circuits(
        model, data.x_train, data.y_train, [0], cfg, torch.Generator().manual_seed(0), layers=["conv2"]
    )
    assert list(only[0]) == ["conv2"] and no_hooks(model)


def test_discovery_rejects_bad_input(trained_cnn):
    model, data = trained_cnn
    x, y = data.x_train, data.y_train
    g = torch.Generator().manual_seed(0)
    cfg = GateConfig(steps=1, batch_size=2)
    with pytest.raises(ValueError, match=r"\[4\] out of range.*4 classes \(0\.\.3\)"):
        discover_circuits(model, x, y, [0, 4], cfg, g)
    with pytest.raises(ValueError, match=r"\[-1\] out of range"):
        discover_one_class(model, x, y, -1, cfg, g)
    with pytest.raises(ConfigError, match="lam must be >= 0, got -0.1"):
        discover_circuits(model, x, y, [0], GateConfig(lam=-0.1), g)
    with pytest.raises(ConfigError, match="steps must be >= 1, got 0"):
        discover_circuits(model, x, y, [0], GateConfig(steps=0), g)
    with pytest.raises(ConfigError, match="choose one of 'ste', 'hard_concrete'"):
        discover_circuits(model, x, y, [0], GateConfig(kind="l1"), g)
    with pytest.raises(ConfigError, match=r"unknown gated layer\(s\) \['conv9'\].*conv1, conv2"):
        discover_circuits(model, x, y, [0], cfg, g, layers=["conv1", "conv9"])
    with pytest.raises(ValueError, match="class 3 has no samples"):
        discover_circuits(model, x[y != 3], y[y != 3], [0, 3], cfg, g)
    with pytest.raises(ValueError, match="duplicates"):
        discover_circuits(model, x, y, [1, 1], cfg, g)
    assert no_hooks(model)


# --- ablation ------------------------------------------------------------------------------


def test_ablation_extremes(trained_cnn):
    model, data = trained_cnn
    x = data.x_test
    full = {n: torch.ones(c, dtype=torch.bool) for n, c in model.gated_layers().items()}
    means = channel_means(model, data.x_train)
    assert {n: m.shape[0] for n, m in means.items()} == model.gated_layers()
    with torch.no_grad():
        baseline = model(x).argmax(1)
    for fill in ("zero", "mean"):
        assert torch.equal(ablate(model, x, full, "sufficiency", fill, means), baseline)
    removed = ablate(model, x, full, "necessity", "zero")
    assert (removed == removed[0]).all()  # no channel left: the head sees only its bias
    assert removed[0] == model.head.bias.argmax()
    assert no_hooks(model)


def test_ablation_report_on_hand_built_circuit():
    model = OneConv()
    x, y = one_hot_data(90, seed=3)
    means = channel_means(model, x)
    mask = {"conv": torch.tensor([False, True, False, False])}  # class 2's circuit
    report = ablation_report(model, x, y, 2, mask, means, torch.Generator().manual_seed(0))
    third = pytest.approx(1 / 3)
    assert report["images"] == 90 and report["class_images"] == 30
    assert report["baseline"].pop("ci95") == {"recall": pytest.approx(0.0568, abs=1e-4),  # Wilson, p = 1, n = 30
                                              "accuracy": pytest.approx(0.0205, abs=1e-4),
                                              "predicted_fraction": pytest.approx(0.0956, abs=1e-4),
                                              "max_predicted_fraction": pytest.approx(0.0956, abs=1e-4)}
    assert report["baseline"] == {"recall": 1.0, "accuracy": 1.0, "predicted_fraction": third,
                                  "max_predicted_fraction": third}
    assert report["circuit_size"] == {"conv": 1}
    # Alone the circuit still finds class 2 (the others tie at logit 0 and fall to class 0).
    assert report["circuit"]["sufficiency"]["zero"].pop("ci95")["recall"] == pytest.approx(0.0568, abs=1e-4)
    assert report["circuit"]["sufficiency"]["zero"] == {
        "recall": 1.0, "accuracy": pytest.approx(2 / 3), "predicted_fraction": third,
        "max_predicted_fraction": pytest.approx(2 / 3),  # classes 0 and 1 both fall to class 0
    }
    assert report["circuit"]["necessity"]["zero"]["recall"] == 0.0
    assert report["circuit"]["necessity"]["zero"]["predicted_fraction"] == 0.0
    assert set(report["random"]["necessity"]) == {"zero", "mean"}
    assert no_hooks(model)


@pytest.mark.parametrize("position", ["after_norm", "before_norm"])
def test_batchnorm_model_at_both_positions(position):
    model = build_model("resnet10", {"widths": [4, 4, 8, 8], "stem": "cifar"}, in_channels=1, num_classes=3, image_size=8)
    model.train()  # discovery must still run in eval mode: BN running stats stay put
    x, y = torch.randn(24, 1, 8, 8), torch.arange(24) % 3
    before = state_hash(model)
    cfg = GateConfig(steps=2, batch_size=4, position=position)
    masks = discover_circuits(model, x, y, [0, 2], cfg, torch.Generator().manual_seed(0))
    assert {n: m.numel() for n, m in masks[2].items()} == model.gated_layers()
    means = channel_means(model, x, position=position)
    full = {n: torch.ones(c, dtype=torch.bool) for n, c in model.gated_layers().items()}
    model.eval()
    with torch.no_grad():
        baseline = model(x).argmax(1)
    assert torch.equal(ablate(model, x, full, "sufficiency", "mean", means, position), baseline)
    assert state_hash(model) == before and no_hooks(model)


# --- empty circuits and degenerate predictors in the diagnostic -------------------------------


def one_client_state(model: FedMechModel, local: dict, glob: dict) -> RoundState:
    """Round 1 with one client (partition 0) whose local and global circuits are given."""
    arrays = model_arrays(model)
    update = ClientUpdate(0, arrays, 90, {}, {"circuits": {"masks": pack_masks(local)}},
                          {"circuits": {"masks": pack_masks(glob)}})
    x, y = one_hot_data(90, seed=3)
    return RoundState(1, arrays, arrays, {0: update}, {"test": (x, y)}, 3, lambda a: model, torch.device("cpu"), 0)


def test_a_class_the_bias_alone_predicts_has_an_empty_circuit_reported_as_bias_only():
    model = BiasOnly()
    x, y = one_hot_data(90, seed=3)
    assert (model(x).argmax(1) == y).all()
    masks = discover_circuits(model, x, y, [0, 2], GateConfig(lam=0.05, steps=100, batch_size=16),
                              torch.Generator().manual_seed(1))
    assert is_empty(masks[2]) and channels(masks[0], "conv") == [2]
    assert (without_channels(model, x) == 2).all()  # every gated channel closed: the bias says 2
    empty = {"conv": np.zeros(4, bool)}
    diag = Circuits(CircuitsConfig(ablations=["cross"], ablation_samples=90))
    record = diag.server_side(one_client_state(model, {0: empty, 2: masks[2]}, {0: masks[0], 2: masks[2]})).metrics
    # class 2's empty circuit needs no channel; class 0's empty local circuit does not explain class 0
    assert record["per_class"]["2"]["bias_only"] == {"local": [0], "global": [0]}
    assert record["per_class"]["0"]["empty"] == {"local": [0], "global": []}
    assert record["per_class"]["0"]["bias_only"] == {"local": [], "global": []}
    assert record["circuit_counts"] == {"local": {"circuits": 2, "empty": 2, "bias_only": 1},
                                        "global": {"circuits": 2, "empty": 1, "bias_only": 1}}
    assert record["per_class"]["2"]["local_to_global"] is None  # empty vs empty: undefined
    assert record["per_class"]["2"]["local_to_global_undefined"] == 1
    assert record["predictions"]["global"] == {"max_predicted_class": 0, "max_predicted_fraction": pytest.approx(1 / 3)}


def test_a_model_that_predicts_one_class_is_flagged(caplog):
    model = OneConv()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([0.0, 0.0, 1.0]))  # always class 2
    circuit = {"conv": np.array([False, True, False, False])}
    diag = Circuits(CircuitsConfig(ablations=["cross"], ablation_samples=90))
    with caplog.at_level("INFO", logger="fedmech_flwr.builtin.diagnostics.circuits.diagnostic"):
        record = diag.server_side(one_client_state(model, {2: circuit}, {2: circuit})).metrics
    assert record["predictions"]["global"] == {"max_predicted_class": 2, "max_predicted_fraction": 1.0}
    assert record["ablation"]["cross"]["2"]["degenerate_sufficiency"] == 1
    assert record["ablation"]["cross"]["2"]["circuit"]["sufficiency"]["zero"]["max_predicted_fraction"] == 1.0
    text = caplog.text
    assert "round 1 | circuit IoU intra_client n/a (0 pairs)" in text
    assert "local_to_global 1.00 (1 pairs)" in text
    assert "degenerate predictor(s), one class for > 90% of 90 test images: global model (class 2: 100%)" in text
    assert "sufficiency ablations that predict one class for > 90% of the test images: cross 1 of 1" in text
