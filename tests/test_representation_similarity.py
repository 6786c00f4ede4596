"""The representation_similarity diagnostic: linear CKA's known answers (a representation
and itself, the transforms it ignores, hand-computed cases, the debiased estimator against
the U-statistic it is), the diagnostic on models that differ only in their head, its checks,
and an in-process run with neural_collapse beside it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from conftest import audit_round_state
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.diagnostics.representation_similarity import (
    RepresentationSimilarity,
    RepresentationSimilarityConfig,
    check_similarity,
    cka,
    cka_matrix,
    hsic,
)
from fedmech_flwr.contracts.outputs import headline
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, model_arrays

NUM_CLASSES = 4


def random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["biased", "debiased"])
def test_cka_of_a_representation_with_itself_is_one(estimator):
    x = random(50, 8)
    assert cka(x, x, estimator) == pytest.approx(1.0, abs=1e-12)
    assert np.diag(cka_matrix([x, random(50, 3, seed=1), x], estimator)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("estimator", ["biased", "debiased"])
def test_cka_ignores_orthogonal_transforms_and_isotropic_scaling_but_not_stretching_one_axis(estimator):
    x, y = random(40, 6), random(40, 5, seed=1)
    y = y + x[:, :5]  # related to x, so the value is not near 0
    q, _ = torch.linalg.qr(random(6, 6, seed=2))
    reference = cka(x, y, estimator)
    assert cka(x @ q, y, estimator) == pytest.approx(reference, abs=1e-10)
    assert cka(3.7 * x, 0.01 * y, estimator) == pytest.approx(reference, abs=1e-10)
    assert cka(x + 5.0, y, estimator) == pytest.approx(reference, abs=1e-10)  # a shift: both centre it away
    stretched = x * torch.tensor([10.0, 1, 1, 1, 1, 1], dtype=torch.float64)
    assert abs(cka(stretched, y, estimator) - reference) > 0.01


def test_cka_of_hand_computed_cases():
    # Kornblith et al.'s (biased) estimator. 1-D representations: CKA is the squared Pearson correlation. x = (1, 2, 3, 4),
    # y = (1, 3, 2, 4): centred (-1.5, -0.5, 0.5, 1.5) and (-1.5, 0.5, -0.5, 1.5), covariance
    # sum 2.25 - 0.25 - 0.25 + 2.25 = 4, both variance sums 5: r = 0.8, CKA = 0.64.
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    y = torch.tensor([[1.0], [3.0], [2.0], [4.0]])
    assert cka(x, y, "biased") == pytest.approx(0.64, abs=1e-12)
    # 2-D, both centred already, Y = X with its second axis doubled: X^T X = diag(2, 2),
    # Y^T Y = diag(2, 8), Y^T X = diag(2, 4), so CKA = ||Y^T X||^2 / (||X^T X|| ||Y^T Y||)
    # = (4 + 16) / (sqrt(8) sqrt(68)) = 10 / sqrt(136) = 0.85749...
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    y = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    assert cka(x, y, "biased") == pytest.approx(10 / np.sqrt(136), abs=1e-12)
    # a constant representation has no CKA
    assert np.isnan(cka(x, torch.ones(4, 3), "biased"))


def test_the_debiased_hsic_is_song_et_al_s_u_statistic():
    """HSIC_1 equals the average over every ordered 4-tuple of distinct samples of
    k_ij l_ij + k_ij l_qr - 2 k_ij l_iq, an unbiased estimator of HSIC by construction."""
    x, y = random(6, 3), random(6, 2, seed=1)
    k, l = (x @ x.T).numpy(), (y @ y.T).numpy()
    tuples = list(itertools.permutations(range(6), 4))
    brute = np.mean([k[i, j] * l[i, j] + k[i, j] * l[q, r] - 2 * k[i, j] * l[i, q] for i, j, q, r in tuples])
    assert hsic(x, y, "debiased") == pytest.approx(brute, rel=1e-10)


def test_the_debiased_estimator_is_unbiased_where_the_biased_one_is_not():
    # independent representations of 8 samples: HSIC is 0; over 2,000 draws the unbiased
    # estimator averages 0 (within 4 standard errors), the biased one well above
    draws = [(random(8, 5, seed=2 * i), random(8, 5, seed=2 * i + 1)) for i in range(2000)]
    unbiased = np.array([hsic(x, y, "debiased") for x, y in draws])
    biased = np.array([hsic(x, y, "biased") for x, y in draws])
    assert abs(unbiased.mean()) < 4 * unbiased.std() / np.sqrt(len(draws))
    assert biased.mean() > 10 * biased.std() / np.sqrt(len(draws))
    # wide independent representations of 1,000 images: biased CKA is far from 0, debiased is not
    wide, other = random(1000, 1000), random(1000, 1000, seed=1)
    assert cka(wide, other, "biased") > 0.45 and abs(cka(wide, other, "debiased")) < 0.01
    # many samples of narrow related representations: the two agree
    x = random(2000, 3, seed=3)
    y = x @ random(3, 4, seed=4) + 0.5 * random(2000, 4, seed=5)
    assert cka(x, y, "debiased") == pytest.approx(cka(x, y, "biased"), abs=0.01)


def with_head(arrays: NamedArrays, seed: int) -> NamedArrays:
    """``arrays`` with a random head: the same body, logits that differ."""
    rng = np.random.default_rng(seed)
    return {**arrays, "head.weight": rng.standard_normal(arrays["head.weight"].shape).astype(np.float32)}


def test_models_that_differ_only_in_their_head_are_alike_everywhere_but_the_head(separable_cnn):
    model, data = separable_cnn
    arrays = model_arrays(model)
    state = audit_round_state(arrays, {0: arrays, 1: with_head(arrays, 1), 2: with_head(arrays, 2)}, data)
    result = RepresentationSimilarity(RepresentationSimilarityConfig(images_per_class=25)).server_side(state)
    record = result.metrics
    assert record["layers"] == ["conv1", "conv2", "penultimate", "head"] and record["images"] == 100
    for layer in ("conv1", "conv2", "penultimate"):
        for key in ("client_client", "client_client_min", "client_global"):
            assert record[key][layer] == pytest.approx(1.0, abs=1e-9)
    assert record["client_client"]["head"] < 0.95 and record["client_client_min"]["head"] <= record["client_client"]["head"]
    assert record["least_similar"]["layer"] == "head" and record["head_least_similar"] == 1.0
    # the matrix of the head: client 0 holds the global model's head, 1 and 2 random ones
    matrix = np.array(record["matrix"]["cka"])
    assert record["matrix"]["rows"] == ["0", "1", "2", "global"] and matrix.shape == (4, 4)
    assert np.diag(matrix) == pytest.approx(1.0) and matrix[0, 3] == pytest.approx(1.0) and matrix[1, 2] < 0.95
    assert set(result.arrays) == {"cka.conv1", "cka.conv2", "cka.penultimate", "cka.head", "partition_ids"}
    assert result.arrays["cka.head"][:3, :3][np.triu_indices(3, 1)].mean() == pytest.approx(record["client_client"]["head"])


def test_one_client_has_no_client_pairs_and_a_chosen_layer_list(separable_cnn):
    model, data = separable_cnn
    arrays = model_arrays(model)
    state = audit_round_state(arrays, {4: with_head(arrays, 1)}, data)
    params = RepresentationSimilarityConfig(layers=["head", "conv2"], matrix_layer="conv2", estimator="biased")
    record = RepresentationSimilarity(params).server_side(state).metrics
    assert record["layers"] == ["conv2", "head"] and record["estimator"] == "biased" and record["images"] == 160
    assert record["client_client"] == {"conv2": None, "head": None} and record["head_least_similar"] is None
    assert record["client_global"]["conv2"] == pytest.approx(1.0) and record["client_global"]["head"] < 0.95
    assert record["matrix"]["layer"] == "conv2" and record["matrix"]["rows"] == ["4", "global"]


def test_a_model_whose_layers_are_constant_has_no_cka_and_is_counted(separable_cnn):
    model, data = separable_cnn
    arrays = model_arrays(model)
    dead = {**arrays, "conv1.weight": np.zeros_like(arrays["conv1.weight"]),
            "conv1.bias": np.zeros_like(arrays["conv1.bias"])}  # every image gives the same activations
    record = RepresentationSimilarity(RepresentationSimilarityConfig()).server_side(
        audit_round_state(arrays, {0: arrays, 1: dead}, data)).metrics
    json.dumps(record, allow_nan=False)  # undefined values are null, not NaN
    assert all(v is None for v in record["client_client"].values()) and record["least_similar"]["layer"] is None
    assert record["client_global"] == pytest.approx({layer: 1.0 for layer in record["layers"]})
    assert record["undefined"] == {layer: 2 for layer in record["layers"]}  # client 1 with client 0 and the global model
    assert record["matrix"]["cka"][1] == [None, None, None]


@pytest.mark.parametrize(
    ("params", "audit_per_class", "match"),
    [
        ({}, 0, "representation_similarity compares .* set data.audit_per_class"),
        ({"layers": ["conv9"]}, 10, r"unknown layer\(s\) \['conv9'\]; model 'simple_cnn' has: conv1, conv2, penultimate, "
                                    r"head.*diagnostics\[0\].layers"),
        ({"layers": []}, 10, r"unknown layer\(s\) \(none given\)"),
        ({"layers": ["conv1"]}, 10, r"matrix_layer 'head' is not one of the compared layers \['conv1'\].*matrix_layer"),
        ({"images_per_class": 1}, 10, r"needs at least 4 images, but 2 are compared.*images_per_class"),
    ],
)
def test_bad_settings_are_refused_before_the_run(make_cfg, params, audit_per_class, match):
    cfg = make_cfg()
    data = DataInfo(torch.arange(400) % 2, 100, 2, (1, 12, 12), audit_per_class)
    with pytest.raises(ConfigError, match=match):
        check_similarity(RepresentationSimilarityConfig(**params), cfg, data, "diagnostics[0]")
    check_similarity(RepresentationSimilarityConfig(layers=["conv2", "head"], estimator="biased", images_per_class=1,
                                                    matrix_layer="conv2"), cfg, DataInfo(
        torch.arange(400) % 2, 100, 2, (1, 12, 12), 10), "diagnostics[0]")


def test_an_in_process_run_records_both_lenses_every_round_and_draws_them(make_cfg, tmp_path):
    cfg = make_cfg("data.audit_per_class=10",
                   "diagnostics=[{name: representation_similarity}, {name: neural_collapse, clients: true}]")
    run = run_in_process(cfg, tmp_path)
    records = read_records(run, "diagnostic")
    similarity = [r for r in records if r["name"] == "representation_similarity"]
    collapse = [r for r in records if r["name"] == "neural_collapse"]
    assert [r["round"] for r in similarity] == [r["round"] for r in collapse] == [1, 2]
    for record in similarity:
        assert record["images"] == 40 and record["clients"] == 3
        assert record["layers"] == ["conv1", "conv2", "penultimate", "head"]
        assert all(-0.5 < v <= 1.0 + 1e-9 for v in record["client_client"].values())
        assert (run / "diagnostics" / "representation_similarity" / f"round_{record['round']:03d}.safetensors").is_file()
    for record in collapse:
        assert set(record["clients"]) == {"0", "1", "2"} and set(record["clients_mean"]) == set(record["global"])
        assert record["global"]["nc1"] > 0 and 0 <= record["global"]["nc3"] <= 4 and 0 <= record["global"]["nc4"] <= 1
    line = " | ".join(headline(read_records(run)))
    assert "client-client CKA, head (logits)" in line and "NC3 classifier vs class means" in line
    for name in ("representation_similarity_layers.png", "representation_similarity_rounds.png",
                 "representation_similarity_matrix.png", "neural_collapse.png"):
        assert (run / "plots" / name).is_file()
