"""Partitioners: known answers for iid, Dirichlet, classes-per-client and class maps."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedmech_flwr.artifacts import plotting
from fedmech_flwr.artifacts.plotting import BARS_UP_TO, plot_label_distribution
from fedmech_flwr.datasets.partition import (
    PARTITIONERS,
    ClassesPerClientConfig,
    ClassMapConfig,
    DirichletConfig,
    label_histograms,
    partition_dataset,
)
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.typed import parse_dataclass

LABELS = np.random.default_rng(0).permutation(np.arange(2000) % 10)  # 200 per class


def check_disjoint_and_sorted(parts, n):
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) and flat.min() >= 0 and flat.max() < n
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)


def test_registered_names():
    assert PARTITIONERS.names() == ["class_map", "classes_per_client", "dirichlet", "iid"]


def test_iid_sizes_differ_by_at_most_one():
    parts = partition_dataset("iid", None, LABELS[:1003], 7, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    check_disjoint_and_sorted(parts, 1003)


def test_dirichlet_disjoint_covering_and_seeded():
    cfg = DirichletConfig(alpha=0.5)
    parts = partition_dataset("dirichlet", cfg, LABELS, 8, seed=3)
    check_disjoint_and_sorted(parts, len(LABELS))
    assert sum(len(p) for p in parts) == len(LABELS)
    assert min(len(p) for p in parts) >= cfg.min_samples
    same = partition_dataset("dirichlet", cfg, LABELS, 8, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same))
    other = partition_dataset("dirichlet", cfg, LABELS, 8, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_dirichlet_huge_alpha_is_near_uniform():
    parts = partition_dataset("dirichlet", DirichletConfig(alpha=1e6), LABELS, 5, seed=0)
    hist = label_histograms(parts, LABELS, 10)
    assert np.all(np.abs(hist - 40) <= 2)  # 200 per class / 5 clients, within 5 %


def test_dirichlet_small_alpha_is_strongly_skewed():
    cfg = DirichletConfig(alpha=0.05, min_samples=1)
    hist = label_histograms(partition_dataset("dirichlet", cfg, LABELS, 5, seed=0), LABELS, 10)
    top_share = hist.max(axis=1) / hist.sum(axis=1)
    assert top_share.mean() > 0.5  # iid would give about 0.1
    assert (hist < 5).sum() >= 25  # most (client, class) cells are (nearly) empty


def test_dirichlet_impossible_min_samples_fails_fast_with_advice():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="lower min_samples"):
        partition_dataset("dirichlet", DirichletConfig(min_samples=300), LABELS, 10, seed=0)
    with pytest.raises(ConfigError, match=r"smallest client had \d+.*raise alpha"):
        cfg = DirichletConfig(alpha=0.01, min_samples=150, max_attempts=20)
        partition_dataset("dirichlet", cfg, LABELS, 10, seed=0)
    assert time.perf_counter() - start < 2


def test_dirichlet_alpha_must_be_positive():
    with pytest.raises(ConfigError, match="alpha must be > 0, got -1"):
        parse_dataclass(DirichletConfig, {"alpha": -1}, "x.yaml: data.partition")


def test_classes_per_client_gives_exactly_k_classes_and_uses_all():
    parts = partition_dataset("classes_per_client", ClassesPerClientConfig(k=2), LABELS, 6, 0)
    hist = label_histograms(parts, LABELS, 10)
    assert ((hist > 0).sum(axis=1) == 2).all()
    assert (hist.sum(axis=0) == 200).all()  # 6 * 2 >= 10: every class used, fully
    check_disjoint_and_sorted(parts, len(LABELS))


def test_classes_per_client_k_above_num_classes():
    with pytest.raises(ConfigError, match="k must be <= the number of classes"):
        partition_dataset("classes_per_client", ClassesPerClientConfig(k=11), LABELS, 3, 0)


def test_class_map_controlled_split():
    cfg = parse_dataclass(ClassMapConfig, {"classes": {0: [0], 1: [3], 2: [6]}}, "x.yaml")
    parts = partition_dataset("class_map", cfg, LABELS, 3, seed=0)
    np.testing.assert_array_equal(parts[1], np.flatnonzero(LABELS == 3))
    assert set(LABELS[parts[0]]) == {0} and set(LABELS[parts[2]]) == {6}


def test_class_map_shared_class_is_split_evenly():
    parts = partition_dataset("class_map", ClassMapConfig({0: [1, 2], 1: [2]}), LABELS, 2, 0)
    hist = label_histograms(parts, LABELS, 10)
    assert hist[0, 1] == 200 and hist[0, 2] == hist[1, 2] == 100


def test_class_map_names_missing_and_extra_clients():
    with pytest.raises(ConfigError, match=r"missing \[2\], extra \[5\]"):
        partition_dataset("class_map", ClassMapConfig({0: [0], 1: [1], 5: [2]}), LABELS, 3, 0)
    with pytest.raises(ConfigError, match="class 12 is outside 0..9"):
        partition_dataset("class_map", ClassMapConfig({0: [12]}), LABELS, 1, 0)


def test_more_clients_than_samples():
    with pytest.raises(ConfigError, match="number of training samples"):
        partition_dataset("iid", None, LABELS[:5], 6, seed=0)


def test_empty_client_is_an_error():
    labels = np.array([0, 0, 1, 1])
    with pytest.raises(ConfigError, match=r"client\(s\) \[1\] without samples"):
        partition_dataset("class_map", ClassMapConfig({0: [0, 1], 1: []}), labels, 2, 0)


def test_label_histograms_and_plot(tmp_path):
    parts = [np.array([0, 1]), np.array([2, 3, 4])]
    hist = label_histograms(parts, np.array([0, 1, 1, 2, 2]), 3)
    np.testing.assert_array_equal(hist, [[1, 1, 0], [0, 1, 2]])
    path = plot_label_distribution(hist, tmp_path / "sub" / "labels.png", ["a", "b", "c"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("num_clients, shapes", [(BARS_UP_TO, 3 * BARS_UP_TO), (100_000, 3)])
def test_label_plot_of_many_clients_draws_a_band_per_class(monkeypatch, tmp_path, num_clients, shapes):
    """A bar per client and class up to ``BARS_UP_TO`` clients; above, one band per class,
    so the plot's cost does not grow with the federation."""
    figures = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: figures.append(fig) or path)
    hist = np.random.default_rng(0).integers(1, 10, size=(num_clients, 3))
    plot_label_distribution(hist, tmp_path / "labels.png")
    (ax,) = figures[0].axes
    assert len(ax.patches) + len(ax.collections) == shapes
    assert ax.get_xlim()[1] == pytest.approx(hist.sum(axis=1).max() * 1.1)
