"""Known answers for the head-level algorithms (fedmech_flwr/learning/heads.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmech_flwr.learning.heads import (
    ClassStats,
    LinearHead,
    LinearTrainConfig,
    balanced_split,
    best_epoch,
    class_stats,
    features,
    ncm_head,
    score,
    tau_normalize,
    train_linear,
    virtual_features,
)

PROBE = LinearTrainConfig(epochs=30, batch_size=32, lr=1e-2, weight_decay=0.0)


def gaussian_classes(n_per_class: int, num_classes: int, dim: int, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(num_classes, dim, generator=g) * 4
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    return centers[y] + spread * torch.randn(len(y), dim, generator=g), y


def zero_head(num_classes: int, dim: int) -> LinearHead:
    return LinearHead(torch.zeros(num_classes, dim), torch.zeros(num_classes))


def test_probe_on_linearly_separable_features_scores_about_one():
    f, y = gaussian_classes(60, 5, 16, spread=0.5, seed=0)
    snapshots = train_linear(f, y, zero_head(5, 16), PROBE, torch.Generator().manual_seed(0))
    assert len(snapshots) == PROBE.epochs + 1
    assert score(snapshots[-1], f, y, 5).accuracy == 1.0
    f_new = f + 0.1 * torch.randn(f.shape, generator=torch.Generator().manual_seed(1))
    assert score(snapshots[-1], f_new, y, 5).accuracy > 0.98


def test_probe_on_random_labels_scores_about_chance():
    g = torch.Generator().manual_seed(0)
    f, f_test = torch.randn(400, 16, generator=g), torch.randn(2000, 16, generator=g)
    y, y_test = torch.randint(0, 5, (400,), generator=g), torch.randint(0, 5, (2000,), generator=g)
    snapshots = train_linear(f, y, zero_head(5, 16), PROBE, torch.Generator().manual_seed(0))
    assert score(snapshots[-1], f_test, y_test, 5).accuracy == pytest.approx(0.2, abs=0.04)


def test_train_linear_is_deterministic_and_starts_from_the_given_head():
    f, y = gaussian_classes(20, 3, 4, spread=1.0, seed=2)
    start = LinearHead(torch.randn(3, 4), torch.randn(3))
    a = train_linear(f, y, start, LinearTrainConfig(), torch.Generator().manual_seed(5))
    b = train_linear(f, y, start, LinearTrainConfig(), torch.Generator().manual_seed(5))
    assert torch.equal(a[0].weight, start.weight) and torch.equal(a[0].bias, start.bias)
    assert all(torch.equal(x.weight, z.weight) for x, z in zip(a, b))
    assert not torch.equal(a[-1].weight, start.weight)


def test_best_epoch_picks_the_most_accurate_snapshot():
    f, y = gaussian_classes(10, 2, 2, spread=0.1, seed=3)
    wrong = LinearHead(torch.zeros(2, 2), torch.tensor([0.0, 1.0]))  # always class 1: 50%
    right = ncm_head(class_stats(f, y, 2), zero_head(2, 2))  # nearest mean: 100%
    assert best_epoch([wrong, right, wrong], f, y, 2) == 1


def test_class_stats_match_numpy_and_add_up_over_disjoint_sets():
    f, y = gaussian_classes(30, 3, 5, spread=2.0, seed=4)
    full = class_stats(f, y, 3, "full")
    diag = class_stats(f, y, 3, "diagonal")
    for c in range(3):
        fc = f[y == c].double().numpy()
        np.testing.assert_allclose(full.means()[c], fc.mean(0), atol=1e-10)
        np.testing.assert_allclose(full.variances()[c], np.cov(fc.T, bias=True), atol=1e-8)
        np.testing.assert_allclose(diag.variances()[c], fc.var(0), atol=1e-8)
    halves = [class_stats(f[:45], y[:45], 3, "full"), class_stats(f[45:], y[45:], 3, "full")]
    summed = ClassStats.sum(halves)
    for key, value in full.to_arrays().items():
        np.testing.assert_allclose(summed.to_arrays()[key], value, atol=1e-9)
    assert ClassStats.from_arrays(full.to_arrays()).covariance == "full"


def test_ncm_head_equals_the_closed_form_nearest_mean_classifier():
    f, y = gaussian_classes(25, 4, 6, spread=3.0, seed=5)  # overlapping classes: a real test
    head = ncm_head(class_stats(f, y, 4), zero_head(4, 6))
    means = torch.stack([f[y == c].mean(0) for c in range(4)])
    nearest = torch.cdist(f.double(), means.double()).argmin(1)
    assert torch.equal(head.predict(f), nearest)
    assert 0.5 < score(head, f, y, 4).accuracy < 1.0


def test_ncm_keeps_the_row_of_a_class_nobody_holds():
    f, y = gaussian_classes(10, 2, 3, spread=1.0, seed=6)
    current = LinearHead(torch.randn(3, 3), torch.randn(3))
    head = ncm_head(class_stats(f, y, 3), current)
    assert torch.equal(head.weight[2], current.weight[2]) and head.bias[2] == current.bias[2]


def test_tau_normalisation():
    head = LinearHead(torch.tensor([[3.0, 4.0], [0.0, 0.5]]), torch.tensor([1.0, -1.0]))
    same = tau_normalize(head, 0.0)
    assert torch.equal(same.weight, head.weight) and torch.equal(same.bias, head.bias)
    unit = tau_normalize(head, 1.0)
    torch.testing.assert_close(unit.weight.norm(dim=1), torch.ones(2))
    torch.testing.assert_close(tau_normalize(head, 0.5).weight[0], head.weight[0] / 5**0.5)
    assert torch.equal(unit.bias, head.bias)


def test_virtual_features_follow_the_class_gaussians():
    f, y = gaussian_classes(200, 2, 3, spread=1.5, seed=7)
    for kind in ("diagonal", "full"):
        stats = class_stats(f, y, 2, kind)
        vf, vy = virtual_features(stats, 20000, torch.Generator().manual_seed(0))
        assert vf.shape == (40000, 3) and torch.equal(torch.bincount(vy), torch.tensor([20000, 20000]))
        for c in range(2):
            np.testing.assert_allclose(vf[vy == c].double().mean(0).numpy(), stats.means()[c], atol=0.05)
            np.testing.assert_allclose(vf[vy == c].double().var(0).numpy(), np.diag(stats.variances()[c]) if kind == "full"
                                       else stats.variances()[c], rtol=0.05)


def test_balanced_split_is_seeded_balanced_and_disjoint():
    y = torch.arange(5).repeat(12)
    picked, rest = balanced_split(y, 3, 5, torch.Generator().manual_seed(0))
    assert torch.equal(torch.bincount(y[picked]), torch.full((5,), 3))
    assert len(set(picked.tolist()) | set(rest.tolist())) == 60 and not set(picked.tolist()) & set(rest.tolist())
    again, _ = balanced_split(y, 3, 5, torch.Generator().manual_seed(0))
    assert torch.equal(picked, again)
    with pytest.raises(ValueError, match="class 0 has 12 samples, 13 are needed"):
        balanced_split(y, 13, 5, torch.Generator())


def test_features_of_a_layer_are_pooled_and_hooks_are_removed(trained_cnn):
    model, data = trained_cnn
    penultimate = features(model, data.x_test)
    assert penultimate.shape == (len(data.x_test), model.feature_dim)
    torch.testing.assert_close(model.forward_head(penultimate), model(data.x_test))
    conv1 = features(model, data.x_test, layer="conv1")
    assert conv1.shape == (len(data.x_test), model.gated_layers()["conv1"])
    assert not model.conv1._forward_hooks
