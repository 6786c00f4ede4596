"""The fast paths of the circuits diagnostic against the plain computations they replace."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from diagnostics.circuits.ablation import MODES, ablate, ablation_reports, channel_means, random_like
from diagnostics.circuits.discovery import learn_circuits, mask_logits
from diagnostics.circuits.gates import GateConfig
from fedmech_flwr.models import build_model
from test_circuits import OneConv, channels, no_hooks, one_hot_data, state_hash


def per_combination(model, x, y, cls, mask, rnd, means, position):
    """The report's scores, one ``ablate`` pass per (circuit or random, mode, fill)."""
    from diagnostics.circuits.ablation import _scores, predict

    n = model.num_classes
    out = {"baseline": _scores(predict(model, x), y, cls, n)}
    for label, m in (("circuit", mask), ("random", rnd)):
        out[label] = {mode: {fill: _scores(ablate(model, x, m, mode, fill, means, position), y, cls, n)
                             for fill in ("zero", "mean")} for mode in MODES}
    return out


def assert_close(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_close(a[key], b[key], f"{where}/{key}")
    elif a is None or b is None:
        assert a is b, where
    else:
        assert abs(a - b) <= 1e-6, where


@pytest.mark.parametrize(("name", "position"), [("simple_cnn", "after_norm"), ("resnet10", "after_norm"),
                                                ("resnet10", "before_norm")])
def test_batched_ablation_equals_one_pass_per_combination(name, position, trained_cnn):
    if name == "simple_cnn":
        model, data = trained_cnn
        x, y = data.x_test, data.y_test
    else:
        torch.manual_seed(0)
        model = build_model("resnet10", {"widths": [4, 4, 8, 8], "stem": "cifar"}, in_channels=1, num_classes=3,
                            image_size=8).eval()
        x, y = torch.randn(30, 1, 8, 8), torch.arange(30) % 3
    before = state_hash(model)
    sizes = model.gated_layers()
    g = torch.Generator().manual_seed(0)
    masks = [{name: torch.rand(k, generator=g) < p for name, k in sizes.items()} for p in (0.2, 0.5, 0.9)]
    masks.append({name: torch.zeros(k, dtype=torch.bool) for name, k in sizes.items()})  # empty circuit
    jobs = [(c % model.num_classes, m, random_like(m, sizes, g)) for c, m in enumerate(masks)]
    means = channel_means(model, x, position=position)
    # batch_size 16: several image batches and several groups per pass
    reports = ablation_reports(model, x, y, jobs, means, position, batch_size=16)
    for (cls, mask, rnd), report in zip(jobs, reports):
        expected = per_combination(model, x, y, cls, mask, rnd, means, position)
        assert_close({k: report[k] for k in expected}, expected, f"class {cls}")
    assert state_hash(model) == before and no_hooks(model)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the replayed layer computes again


def test_batched_ablation_on_the_hand_built_circuit():
    model = OneConv()
    x, y = one_hot_data(90, seed=3)
    circuit = {"conv": torch.tensor([False, True, False, False])}
    (report,) = ablation_reports(model, x, y, [(2, circuit, circuit)], None)
    assert report["circuit"]["sufficiency"]["zero"]["recall"] == 1.0
    assert report["circuit"]["necessity"]["zero"]["recall"] == 0.0
    assert set(report["circuit"]["necessity"]) == {"zero"}  # no means: no mean fill


def test_warm_start_reproduces_the_cold_mask_on_the_hand_built_circuit():
    model = OneConv()
    x, y = one_hot_data()
    cold_cfg = GateConfig(lam=0.05, steps=100, batch_size=16, patience=None)
    cold = learn_circuits(model, x, y, [0, 1, 2], cold_cfg, torch.Generator().manual_seed(1))
    assert cold.steps == 100  # no patience: the paper's fixed number of steps
    assert {c: channels(m, "conv") for c, m in cold.masks.items()} == {c: [k] for c, k in OneConv.CIRCUIT.items()}
    warm_cfg = dataclasses.replace(cold_cfg, patience=5, min_steps=10)
    for start in (cold.logits, {c: mask_logits(m, 2.0) for c, m in cold.masks.items()}):
        warm = learn_circuits(model, x, y, [0, 1, 2], warm_cfg, torch.Generator().manual_seed(2), start=start)
        assert all(torch.equal(warm.masks[c]["conv"], cold.masks[c]["conv"]) for c in cold.masks)
        assert warm.steps == 10  # the mask never changes: it stops as soon as min_steps allows
    assert no_hooks(model)


def test_early_stopping_stops_and_never_before_min_steps():
    model = OneConv()
    x, y = one_hot_data()
    cfg = GateConfig(lam=0.05, steps=300, batch_size=16, patience=10, min_steps=40)
    found = learn_circuits(model, x, y, [0, 1, 2], cfg, torch.Generator().manual_seed(1))
    assert 40 <= found.steps < 300
    assert {c: channels(m, "conv") for c, m in found.masks.items()} == {c: [k] for c, k in OneConv.CIRCUIT.items()}
    late = dataclasses.replace(cfg, min_steps=found.steps + 20)
    assert learn_circuits(model, x, y, [0, 1, 2], late, torch.Generator().manual_seed(1)).steps == found.steps + 20
    stable = {c: mask_logits(m, 2.0) for c, m in found.masks.items()}
    fixed = dataclasses.replace(cfg, patience=1, min_steps=25)
    assert learn_circuits(model, x, y, [0, 1, 2], fixed, torch.Generator().manual_seed(1), start=stable).steps == 25


def test_each_class_stops_on_its_own_so_vectorised_still_equals_class_by_class(trained_cnn):
    model, data = trained_cnn
    x, y = data.x_train, data.y_train
    cfg = GateConfig(lam=0.05, lr=0.2, steps=120, batch_size=32, patience=5, min_steps=10)
    together = learn_circuits(model, x, y, [0, 1, 2, 3], cfg, torch.Generator().manual_seed(5))
    alone = [learn_circuits(model, x, y, [c], dataclasses.replace(cfg, batch_size=8), torch.Generator().manual_seed(5))
             for c in range(4)]
    assert together.steps == max(a.steps for a in alone) and min(a.steps for a in alone) < 120
    for c, a in enumerate(alone):
        for layer in model.gated_layers():
            assert torch.equal(a.masks[c][layer], together.masks[c][layer]), (c, layer)
            assert torch.allclose(a.logits[c][layer], together.logits[c][layer], atol=1e-5), (c, layer)


@pytest.mark.parametrize("kind", ["ste", "hard_concrete"])
def test_gating_at_the_pooled_point_learns_what_gating_at_the_conv_output_learns(trained_cnn, kind):
    """SimpleCNN's gates act after ReLU and max-pool in discovery: the same circuits and
    gate logits as at the conv output (where a closed STE gate passes no gradient), and
    the pooled point is really used (no hook on the conv)."""
    model, data = trained_cnn
    x, y = data.x_train, data.y_train
    cfg = GateConfig(kind=kind, lam=0.05, lr=0.2, steps=60, batch_size=32, patience=None)
    at_conv = copy.deepcopy(model)
    at_conv.pooled_gate_module = lambda name: None  # the gate point itself
    pooled = learn_circuits(model, x, y, [0, 1, 2, 3], cfg, torch.Generator().manual_seed(5))
    plain = learn_circuits(at_conv, x, y, [0, 1, 2, 3], cfg, torch.Generator().manual_seed(5))
    closed = 0
    for c in range(4):
        for layer in model.gated_layers():
            assert torch.equal(pooled.masks[c][layer], plain.masks[c][layer]), (c, layer)
            assert torch.allclose(pooled.logits[c][layer], plain.logits[c][layer], atol=1e-5), (c, layer)
            closed += int((~plain.masks[c][layer]).sum())
    assert closed > 0  # some gates closed, so the closed-gate gradient was exercised

    seen = []
    handles = [model.conv1.register_forward_hook(lambda m, i, out: seen.append("conv1")),
               model.pooled["conv1"].register_forward_hook(lambda m, i, out: seen.append(out.shape[-1]))]
    try:
        learn_circuits(model, x, y, [0], dataclasses.replace(cfg, steps=1), torch.Generator())
    finally:
        for handle in handles:
            handle.remove()
    assert seen == ["conv1", x.shape[-1] // 2]  # one pass; the pooled block end is half the side
