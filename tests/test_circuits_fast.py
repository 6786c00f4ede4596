"""The fast paths of the circuits diagnostic against the plain computations they replace."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_circuits import OneConv, channels, no_hooks, one_hot_data, state_hash

from fedmech_flwr.builtin.diagnostics.circuits.ablation import MODES, ablate, ablation_reports, channel_means, random_like
from fedmech_flwr.builtin.diagnostics.circuits.discovery import learn_circuits, mask_logits
from fedmech_flwr.builtin.diagnostics.circuits.gates import GateConfig, channel_view, gated, patched, ste_gate
from fedmech_flwr.models import build_model
from fedmech_flwr.models.simple_cnn import GroupedForward


def per_combination(model, x, y, cls, mask, rnd, means, position):
    """The report's scores, one ``ablate`` pass per (circuit or random, mode, fill)."""
    from fedmech_flwr.builtin.diagnostics.circuits.ablation import _scores, predict

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


def pruned(model, fraction: float, seed: int = 0):
    """A copy of ``model`` with ``fraction`` of each conv's 3x3 kernels set to 0 (seeded):
    channels that read no input-dependent channel become static, as after the paper's
    pruning (at 99.9%, most kernels are empty)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in model.gated_layers():
            weight = getattr(model, name).weight
            weight[torch.rand(weight.shape[:2], generator=g) < fraction] = 0.0
    return model


@pytest.mark.parametrize("fraction", [0.0, 0.85, 1.0])
def test_grouped_forward_equals_the_model_with_hooked_edits(fraction):
    """SimpleCNN's grouped forward: the logits and gate gradients of the model with the same
    per-sample edits hooked in, with none, some and all channels static."""
    torch.manual_seed(0)
    model = pruned(build_model("simple_cnn", {"channels": [6, 8, 8]}, in_channels=2, num_classes=3, image_size=16),
                   fraction).eval()
    grouped = GroupedForward(model)
    live, sizes = list(grouped.live_channels.values()), model.gated_layers()
    assert (live == list(sizes.values())) if fraction == 0 else (sum(live) < sum(sizes.values()))
    assert (model.grouped_forward() is None) == (fraction == 0)  # nothing static: the hooked model is faster
    if fraction == 0.85:
        assert live[-1] > 0  # some channels live to the end, some static
    x, group = torch.randn(12, 2, 16, 16), torch.arange(3).repeat_interleave(4)  # group-major
    logits = {name: torch.randn(3, k) for name, k in sizes.items()}
    for g in logits.values():
        g[:, 0] = -1.0  # closed in every group: computed once per group
        g.requires_grad_(True)
    gates = {name: ste_gate(g, closed_gradient=False) for name, g in logits.items()}
    with gated(model, {name: v[group] for name, v in gates.items()}, pooled=True):
        hooked = model(x)
    fast = grouped(x, 3, at_end=gates)
    assert torch.allclose(fast, hooked, atol=1e-5)
    for a, b in zip(torch.autograd.grad(fast.sum(), list(logits.values()), retain_graph=True),
                    torch.autograd.grad(hooked.sum(), list(logits.values())), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    scale = {name: (torch.rand(3, k) < 0.6).float() for name, k in sizes.items()}
    for v in scale.values():
        v[:, 0] = 0.0  # replaced in every group
    shift = {name: torch.randn(3, k) * (1 - scale[name]) for name, k in sizes.items()}
    edits = {name: lambda out, a=scale[name][group], b=shift[name][group]: out * channel_view(a, out)
             + channel_view(b, out) for name in sizes}
    with torch.no_grad(), patched(model, edits):
        hooked = model(x)
    fast = grouped(x, 3, at_conv={name: (scale[name], shift[name]) for name in sizes})
    assert torch.allclose(fast, hooked, atol=1e-5)


@pytest.mark.parametrize(("name", "position"), [("simple_cnn", "after_norm"), ("simple_cnn pruned", "after_norm"),
                                                ("resnet10", "after_norm"), ("resnet10", "before_norm")])
def test_batched_ablation_equals_one_pass_per_combination(name, position, trained_cnn):
    if name.startswith("simple_cnn"):
        model, data = trained_cnn
        model = pruned(model, 0.7) if name.endswith("pruned") else model
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


@pytest.mark.parametrize(("kind", "fraction"), [("ste", 0.0), ("hard_concrete", 0.0), ("ste", 0.5)])
def test_gating_at_the_pooled_point_learns_what_gating_at_the_conv_output_learns(trained_cnn, kind, fraction):
    """SimpleCNN's gates act after ReLU and max-pool in discovery, with STE on a pruned model
    in its grouped forward: the same circuits and gate logits as hooked at the conv output
    (where a closed STE gate passes no gradient), and the fast path is really used."""
    model, data = trained_cnn
    model = pruned(model, fraction)
    grouped = model.grouped_forward() is not None and kind == "ste"
    assert grouped == (fraction > 0)
    x, y = data.x_train, data.y_train
    cfg = GateConfig(kind=kind, lam=0.05, lr=0.2, steps=60, batch_size=32, patience=None)
    at_conv = copy.deepcopy(model)
    at_conv.pooled_gate_module = lambda name: None  # the gate point itself,
    at_conv.grouped_forward = lambda: None  # through hooks
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
    # the grouped forward calls no module; hooks gate at the pooled block end (half the side)
    assert seen == ([] if grouped else ["conv1", x.shape[-1] // 2])
