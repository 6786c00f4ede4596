"""The neural_collapse diagnostic: NC1 to NC4 at collapse (a simplex ETF of class means, no
spread inside a class, the classifier the normalised means), on a hand-computed
configuration that is not collapsed, FedETF's fixed head (alone and in a run), and the
diagnostic on a model. The in-process run with both new diagnostics is in
tests/test_representation_similarity.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import audit_round_state
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.diagnostics.neural_collapse import (
    METRICS,
    NeuralCollapse,
    NeuralCollapseConfig,
    check_collapse,
    collapse,
)
from fedmech_flwr.builtin.strategies.fedetf import simplex_etf
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import model_arrays
from fedmech_flwr.learning.heads import LinearHead


def head(weight, bias=None) -> LinearHead:
    weight = torch.as_tensor(np.asarray(weight, dtype=np.float64))
    return LinearHead(weight, torch.zeros(len(weight), dtype=torch.float64) if bias is None
                      else torch.as_tensor(np.asarray(bias, dtype=np.float64)))


def test_a_collapsed_configuration_has_the_ideal_values():
    # 5 classes: class means a simplex ETF (scaled by 3) around a shared offset, every image
    # at its class mean, the classifier the normalised means
    classes, dim = 5, 8
    etf = simplex_etf(classes, dim, seed=0)
    labels = torch.arange(classes).repeat(4)
    features = torch.as_tensor(3.0 * etf[labels.numpy()] + np.linspace(-1.0, 1.0, dim))
    nc = collapse(features, labels, head(etf), classes)
    assert set(nc) == set(METRICS)
    assert all(value == pytest.approx(0.0, abs=1e-9) for value in nc.values()), nc


def test_a_hand_computed_configuration():
    # 3 classes in 2-D, two images each; the class means (2, 0), (-1, 1), (-1, -1) sum to 0,
    # so they are the centred means M and mu_G = 0
    features = torch.tensor([[2.0, 1.0], [2.0, -1.0],      # class 0: deviations (0, +-1)
                             [0.0, 1.0], [-2.0, 1.0],      # class 1: deviations (+-1, 0)
                             [0.0, -1.0], [-2.0, -1.0]])   # class 2: deviations (+-1, 0)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    nc = collapse(features, labels, head([[1.0, 0.0], [0.0, 1.0], [-1.0, -2.0]], [0.0, 0.0, -3.0]), 3)
    # NC1: Sigma_W = diag(0 + 2 + 2, 2 + 0 + 0) / 6 = diag(2/3, 1/3), Sigma_B = M^T M / 3 =
    # diag(6, 2) / 3, Sigma_B^+ = diag(1/2, 3/2): Tr = 1/3 + 1/2 = 5/6, over C = 3: 5/18
    assert nc["nc1"] == pytest.approx(5 / 18)
    # NC2 of the means: norms 2, sqrt 2, sqrt 2, their CV = (sqrt 2 - 1)^2 = 3 - 2 sqrt 2;
    # cosines -1/sqrt 2, -1/sqrt 2, 0: std 1/3, mean |cos + 1/2| = (sqrt 2 - 1/2) / 3
    assert nc["nc2_equinorm"] == pytest.approx(3 - 2 * np.sqrt(2))
    assert nc["nc2_equiangular"] == pytest.approx(1 / 3)
    assert nc["nc2_max_angle"] == pytest.approx((np.sqrt(2) - 0.5) / 3)
    # NC2 of the classifier rows (1, 0), (0, 1), (-1, -2): norms 1, 1, sqrt 5, CV =
    # 2 sqrt(3 - sqrt 5) / (2 + sqrt 5); cosines 0, -1/sqrt 5, -2/sqrt 5: std sqrt(2/15),
    # mean |cos + 1/2| = (1/2 + 1/sqrt 5) / 3
    assert nc["nc2_classifier_equinorm"] == pytest.approx(2 * np.sqrt(3 - np.sqrt(5)) / (2 + np.sqrt(5)))
    assert nc["nc2_classifier_equiangular"] == pytest.approx(np.sqrt(2 / 15))
    assert nc["nc2_classifier_max_angle"] == pytest.approx((0.5 + 1 / np.sqrt(5)) / 3)
    # NC3: ||W||_F^2 = 7, ||M||_F^2 = 8, <W, M> = 2 + 1 + 3 = 6: 2 - 2 * 6 / sqrt 56 = 2 - 6 / sqrt 14
    assert nc["nc3"] == pytest.approx(2 - 6 / np.sqrt(14))
    # NC4: the nearest class mean is every image's own class; the head (bias -3 on class 2)
    # labels (0, -1) as class 0 (scores 0, -1, -1): 1 of 6
    assert nc["nc4"] == pytest.approx(1 / 6)


def test_fedetf_s_fixed_head_is_a_simplex_etf_and_the_spread_of_features_is_scale_free():
    labels = torch.arange(4).repeat(25)
    features = torch.randn(100, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    features[:, :4] += 2.0 * torch.nn.functional.one_hot(labels, 4)
    nc = collapse(features, labels, head(simplex_etf(4, 16, seed=3)), 4)
    for key in ("nc2_classifier_equinorm", "nc2_classifier_equiangular", "nc2_classifier_max_angle"):
        assert nc[key] == pytest.approx(0.0, abs=1e-9)
    assert nc["nc1"] > 0.1 and nc["nc2_equinorm"] > 0.0
    scaled = collapse(10.0 * features, labels, head(simplex_etf(4, 16, seed=3)), 4)
    assert scaled == pytest.approx(nc)


def test_features_at_one_point_have_no_class_means_to_measure():
    nc = collapse(torch.ones(8, 3), torch.arange(4).repeat(2), head(np.eye(4, 3)), 4)
    assert nc["nc1"] is None and nc["nc3"] is None and nc["nc2_equinorm"] is None and nc["nc2_max_angle"] is None
    with pytest.raises(ValueError, match="every one of the 4 classes"):
        collapse(torch.ones(8, 3), torch.zeros(8, dtype=torch.long), head(np.eye(4, 3)), 4)


def test_the_diagnostic_measures_the_global_model_and_its_clients(separable_cnn):
    model, data = separable_cnn
    arrays = model_arrays(model)
    rolled = {**arrays, "head.weight": np.roll(arrays["head.weight"], 1, axis=0),
              "head.bias": np.roll(arrays["head.bias"], 1, axis=0)}
    state = audit_round_state(arrays, {0: arrays, 3: rolled}, data)
    assert "clients" not in NeuralCollapse(NeuralCollapseConfig()).server_side(state).metrics
    record = NeuralCollapse(NeuralCollapseConfig(clients=True)).server_side(state).metrics
    assert record["images"] == 160 and set(record["clients"]) == {"0", "3"}
    assert record["clients"]["0"] == record["global"]
    # a head that reads class c as c + 1: the features are the same, the head no longer
    # matches its own class means
    assert record["global"]["nc4"] < 0.1 and record["clients"]["3"]["nc4"] > 0.9
    assert record["clients"]["3"]["nc3"] > record["global"]["nc3"] + 0.5
    assert record["clients"]["3"]["nc1"] == pytest.approx(record["global"]["nc1"])
    assert record["clients_mean"]["nc3"] == pytest.approx((record["global"]["nc3"] + record["clients"]["3"]["nc3"]) / 2)


def test_a_run_without_an_audit_set_is_refused():
    with pytest.raises(ConfigError, match="neural_collapse measures .* set data.audit_per_class"):
        check_collapse(NeuralCollapseConfig(), None, DataInfo(torch.arange(40) % 4, 10, 4, (1, 8, 8), 0), "diagnostics[1]")


def test_under_fedetf_the_global_classifier_is_a_simplex_etf_every_round(make_cfg, tmp_path):
    cfg = make_cfg("strategy={name: fedetf}", "client={name: etf}", "data.audit_per_class=10",
                   "diagnostics=[{name: neural_collapse}]")
    records = read_records(run_in_process(cfg, tmp_path), "diagnostic")
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        for key in ("nc2_classifier_equinorm", "nc2_classifier_equiangular", "nc2_classifier_max_angle"):
            assert record["global"][key] == pytest.approx(0.0, abs=1e-5)
        assert record["global"]["nc3"] > 0.0  # the features' class means are not yet the ETF
