"""Universal sparse autoencoders (diagnostics.usae): known answers on tiny inputs."""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmech_flwr.builtin.diagnostics.usae.activations import InMemorySource, StreamingSource, collect_tokens
from fedmech_flwr.builtin.diagnostics.usae.analysis import FIT_R2, analyse
from fedmech_flwr.builtin.diagnostics.usae.metrics import (
    ConceptOverlap,
    calibrated_overlap,
    concept_activity,
    concept_mask,
    dead_fraction,
    explained_variance,
    finish_from_layer,
    l0,
    min_unique_count,
    r2_matrix,
    shared_unique,
    stitch_accuracy,
)
from fedmech_flwr.builtin.diagnostics.usae.model import USAE, USAEConfig, load_usae, save_usae
from fedmech_flwr.builtin.diagnostics.usae.train import train_usae
from fedmech_flwr.datasets.data import SyntheticConfig, load_dataset
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.typed import parse_dataclass
from fedmech_flwr.models import build_model

SMALL = {"dict_size": 32, "k": 3, "epochs": 20, "batch_size": 128, "lr": 1e-2, "min_steps": 0}
"""20 passes of 16 batches over 2,000 planted tokens: 320 steps, R^2 about 0.98 (no floor needed)."""


def planted(features: torch.Tensor, n: int, active: int, g: torch.Generator) -> torch.Tensor:
    """Tokens that are sums of ``active`` random rows of ``features``, weights U(0.5, 1.5)."""
    rows = torch.rand(n, len(features), generator=g).argsort(1)[:, :active]
    codes = torch.zeros(n, len(features)).scatter_(1, rows, 0.5 + torch.rand(n, active, generator=g))
    return codes @ features


def identity_usae(width: int = 4) -> USAE:
    """Two models, dictionary [I; -I] in both, k = width: x = relu(x) - relu(-x) exactly."""
    usae = USAE([width, width], 2 * width, width)
    signed = torch.cat([torch.eye(width), -torch.eye(width)])
    with torch.no_grad():
        for site in usae.sites:
            site.encoder.weight.copy_(signed)
            site.encoder.bias.zero_()
            site.decoder.copy_(signed)
            site.decoder_bias.zero_()
    return usae


def tiny_cnn(channels: list[int]):
    return build_model("simple_cnn", {"channels": channels}, in_channels=1, num_classes=4, image_size=8)


@pytest.fixture(scope="module")
def data():
    return load_dataset("synthetic", SyntheticConfig(num_train=160, num_test=80, num_classes=4, image_size=8))


# --- model --------------------------------------------------------------------------------


def test_topk_keeps_exactly_k_concepts():
    usae = USAE([6, 5], 64, 5, torch.Generator().manual_seed(0))
    codes = usae.encode(0, torch.randn(50, 6))
    assert codes.shape == (50, 64)
    assert ((codes != 0).sum(1) == 5).all() and (codes >= 0).all()
    assert l0(codes) == 5.0


def test_identity_usae_reconstructs_exactly_and_shares_every_concept():
    usae = identity_usae()
    x = torch.randn(100, 4)
    for j in (0, 1):
        assert torch.allclose(usae.decode(j, usae.encode(0, x)), x, atol=1e-6)
    np.testing.assert_allclose(r2_matrix(usae, [x, x.clone()]), np.ones((2, 2)), atol=1e-6)
    overlap = shared_unique(concept_activity(usae, [x, x.clone()]))
    assert overlap == ConceptOverlap(shared=8, unique=[0, 0], dead=0, alive=8)
    assert overlap.overlap == 1.0


def test_decode_returns_the_original_space():
    usae = identity_usae()
    mean, std = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([2.0, 0.5, 1.0, 4.0])
    usae.set_standardiser(1, mean, std)
    x = mean + std * torch.randn(30, 4)
    assert torch.allclose(usae.decode(1, usae.encode(1, x)), x, atol=1e-5)


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ConfigError, match=r"k=9 exceeds the dictionary size 8"):
        USAE([4, 4], 8, 9)
    with pytest.raises(ConfigError, match=r"at least 2 models"):
        USAE([4], 8, 2)
    with pytest.raises(ConfigError, match=r"k must be >= 1"):
        parse_dataclass(USAEConfig, {"k": 0}, "usae")
    with pytest.raises(ValueError, match=r"model 0 has width 4, got tokens of width 3"):
        identity_usae().encode(0, torch.randn(2, 3))


def test_save_and_load_round_trip(tmp_path):
    usae = USAE([3, 5], 16, 2, torch.Generator().manual_seed(0))
    usae.set_standardiser(1, torch.arange(5.0), torch.full((5,), 2.0))
    save_usae(tmp_path / "usae.safetensors", usae)
    loaded = load_usae(tmp_path / "usae.safetensors")
    assert (loaded.widths, loaded.dict_size, loaded.k) == ([3, 5], 16, 2)
    x = torch.randn(7, 5)
    assert torch.equal(loaded.decode(0, loaded.encode(1, x)), usae.decode(0, usae.encode(1, x)))


# --- training -----------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["per_model", "joint"])
def test_identical_models_give_a_symmetric_r2_matrix_and_shared_concepts(norm):
    g = torch.Generator().manual_seed(0)
    x = planted(torch.randn(8, 6, generator=g), 2000, 2, g)
    tokens = [x, x.clone()]
    usae, history = train_usae(InMemorySource(tokens), USAEConfig(**SMALL, decoder_norm=norm))
    r2 = r2_matrix(usae, tokens)
    assert r2.min() > 0.9 and np.abs(r2 - r2.T).max() < 0.01
    assert shared_unique(concept_activity(usae, tokens), threshold=0.01).overlap >= 0.9
    assert history["mse"][-1] < history["mse"][0] / 5
    assert torch.allclose(usae.decoder_norms(norm), torch.ones(1), atol=1e-5)


def test_the_symmetric_schedule_keeps_two_copies_of_a_model_identical(trained_cnn):
    """Two copies of one model's conv2 tokens (1,025, so every pass ends in a batch of one
    token: the identity holds whatever the batch's shape): the symmetric schedule ends with
    bitwise equal sites and every concept shared; the paper's round robin trains each
    encoder on its own batches, and the copies end apart."""
    model, data = trained_cnn
    x = collect_tokens([model], "conv2", data.x_train[:65])[0][:1025]
    cfg = USAEConfig(dict_size=32, k=4, epochs=30, batch_size=128, min_steps=0, dead_after=50)
    symmetric, _ = train_usae(InMemorySource([x, x.clone()]), dataclasses.replace(cfg, schedule="symmetric"))
    a, b = symmetric.sites
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    counts = concept_activity(symmetric, [x, x]) * len(x)
    assert calibrated_overlap(counts)[0].overlap == shared_unique(counts).overlap == 1.0
    round_robin, _ = train_usae(InMemorySource([x, x.clone()]), cfg)
    a, b = round_robin.sites
    assert not torch.equal(a.encoder.weight, b.encoder.weight)


class _RecordingSource(InMemorySource):
    """Records the size of every batch drawn."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.sizes: list[int] = []

    def batches(self, batch_size, generator):
        for batch in super().batches(batch_size, generator):
            self.sizes.append(len(batch[0]))
            yield batch


def test_a_symmetric_epoch_takes_the_round_robin_steps_on_a_share_of_the_batch():
    """1,000 tokens, batch 128, 3 models: a round-robin epoch is 8 steps of 128 tokens (one
    model each); a symmetric one is 8 steps of 43 tokens that every model encodes, drawn
    from passes one after another."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randn(1000, 4, generator=g) for _ in range(3)]
    cfg = USAEConfig(dict_size=16, k=2, epochs=3, batch_size=128, min_steps=0)
    for schedule, step_tokens in (("round_robin", 128), ("symmetric", 43)):
        source = _RecordingSource(tokens)
        _, history = train_usae(source, dataclasses.replace(cfg, schedule=schedule))
        assert history["steps"] == [8, 16, 24]
        drawn = source.sizes[8:]  # after token_stats' pass
        assert drawn[0] == step_tokens and len(drawn) >= 24


def test_disjoint_planted_features_give_mostly_unique_concepts():
    g = torch.Generator().manual_seed(0)
    features_a, features_b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    tokens = [planted(features_a, 2000, 2, g), planted(features_b, 2000, 2, g)]
    usae, _ = train_usae(InMemorySource(tokens), USAEConfig(**SMALL, decoder_norm="joint"))
    r2 = r2_matrix(usae, tokens)
    assert np.diag(r2).min() > 0.85 and np.abs(r2[[0, 1], [1, 0]]).max() < 0.05
    overlap = shared_unique(concept_activity(usae, tokens), threshold=0.01)
    assert overlap.overlap < 0.3 and min(overlap.unique) > overlap.shared


def test_training_converges_to_near_perfect_reconstruction():
    g = torch.Generator().manual_seed(0)
    x = planted(torch.randn(4, 4, generator=g), 1000, 2, g)  # 4 features in width 4
    tokens = [x, x @ torch.randn(4, 4, generator=g)]  # model 1: an invertible map of model 0
    cfg = USAEConfig(dict_size=8, k=4, epochs=100, batch_size=100, lr=1e-2)
    usae, history = train_usae(InMemorySource(tokens), cfg)
    assert r2_matrix(usae, tokens).min() > 0.95 and history["mse"][-1] < 0.05


def test_a_tiny_token_set_is_trained_to_min_steps_and_fits():
    """200 tokens are 2 batches a pass: 2 passes alone are 4 steps and explain little. The
    tokens are sums of 2 of 8 planted features and k = 3, so a dictionary holding the 8
    explains them all; 1,000 steps get R^2 about 0.98, and 0.9 is asserted (far above the
    fit bound of 0.5 and the 0.16 of 4 steps)."""
    g = torch.Generator().manual_seed(0)
    x = planted(torch.randn(8, 6, generator=g), 200, 2, g)
    tokens = [x, x.clone()]
    cfg = USAEConfig(dict_size=32, k=3, epochs=2, batch_size=128, lr=1e-2)
    usae, history = train_usae(InMemorySource(tokens), cfg)
    assert cfg.min_steps == 1000 and history["steps"][-1] == 1000 and len(history["steps"]) == 500
    assert np.diag(r2_matrix(usae, tokens)).min() > 0.9
    usae, history = train_usae(InMemorySource(tokens), dataclasses.replace(cfg, min_steps=0))
    assert history["steps"] == [2, 4] and np.diag(r2_matrix(usae, tokens)).max() < FIT_R2


def test_an_under_trained_usae_is_flagged_not_fit(trained_cnn, caplog):
    model, data = trained_cnn
    models, names = [model, copy.deepcopy(model)], ["a", "b"]
    x, y = data.x_test[:20], data.y_test[:20]  # 320 tokens at conv2: 5 steps a pass
    quick = USAEConfig(dict_size=32, k=4, epochs=1, batch_size=64, min_steps=0)
    with caplog.at_level(logging.WARNING, logger="fedmech_flwr.builtin.diagnostics.usae.analysis"):
        _, metrics = analyse(models, names, "conv2", x, y, quick)
    assert metrics["fit"] is False and min(metrics["r2"][0][0], metrics["r2"][1][1]) < FIT_R2
    assert "USAE at conv2 is not fit: self-reconstruction R^2 a " in caplog.text
    assert "after 5 steps over 320 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedmech_flwr.builtin.diagnostics.usae.analysis"):
        _, metrics = analyse(models, names, "conv2", x, y, dataclasses.replace(quick, min_steps=1000))
    assert metrics["fit"] is True and min(metrics["r2"][0][0], metrics["r2"][1][1]) >= FIT_R2
    assert "not fit" not in caplog.text


def test_aux_loss_runs_on_dead_concepts():
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    cfg = USAEConfig(dict_size=64, k=2, epochs=3, batch_size=64, dead_after=1, aux_k=8)
    _, history = train_usae(InMemorySource([x, x.clone()]), cfg)
    assert all(a > 0 for a in history["aux"]) and history["dead_fraction"][-1] > 0
    assert np.isfinite(history["loss"]).all()


def test_empty_activation_sets_are_clear_errors(data):
    with pytest.raises(ValueError, match=r"activation set is empty"):
        InMemorySource([torch.zeros(0, 4), torch.zeros(0, 4)])
    with pytest.raises(ValueError, match=r"not aligned"):
        InMemorySource([torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"x is empty"):
        collect_tokens([tiny_cnn([4, 8])], "conv1", data.x_train[:0])


# --- activations --------------------------------------------------------------------------


def test_collect_tokens_shapes_and_order(data):
    a, b = tiny_cnn([4, 8]), tiny_cnn([3, 6])
    x = data.x_train[:5]
    tokens = collect_tokens([a, b], "conv2", x, batch_size=2)
    assert [t.shape for t in tokens] == [(5 * 4 * 4, 8), (5 * 4 * 4, 6)]
    feature_map = a.conv2(F.max_pool2d(F.relu(a.conv1(x)), 2))  # [5, 8, 4, 4]
    b_, h, w = 3, 2, 1
    assert torch.allclose(tokens[0][b_ * 16 + h * 4 + w], feature_map[b_, :, h, w], atol=1e-6)
    assert collect_tokens([a], "conv1", x)[0].shape == (5 * 8 * 8, 4)


def test_missing_layer_names_the_model_and_valid_layers(data):
    message = r"model 1 has no gated layer 'conv3'; its gated layers are: conv1, conv2"
    with pytest.raises(ConfigError, match=message):
        collect_tokens([tiny_cnn([2, 2, 2]), tiny_cnn([2, 2])], "conv3", data.x_train[:2])


def test_streaming_source_yields_aligned_batches_of_all_tokens(data):
    model = tiny_cnn([4, 8])
    x = data.x_train[:10]
    source = StreamingSource([model, copy.deepcopy(model)], "conv2", x, images_per_chunk=4)
    batches = list(source.batches(48, torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for a, b in batches)
    assert [len(a) for a, _ in batches] == [48, 48, 48, 16]
    streamed = torch.cat([a for a, _ in batches])
    expected = collect_tokens([model], "conv2", x)[0]
    by_first = streamed[:, 0].argsort(), expected[:, 0].argsort()
    assert torch.allclose(streamed[by_first[0]], expected[by_first[1]], atol=1e-6)


# --- metrics ------------------------------------------------------------------------------


def test_explained_variance_matches_numpy():
    x, x_hat = torch.randn(40, 3), torch.randn(40, 3)
    xn, hn = x.double().numpy(), x_hat.double().numpy()
    expected = 1 - ((xn - hn) ** 2).sum() / ((xn - xn.mean(0)) ** 2).sum()
    assert explained_variance(x, x_hat) == pytest.approx(expected, rel=1e-9)
    assert explained_variance(x, x) == 1.0
    assert explained_variance(x, x.mean(0).expand_as(x)) == pytest.approx(0.0, abs=1e-9)


def test_l0_dead_fraction_and_concept_counts():
    codes_a = torch.tensor([[1.0, 0, 0, 0, 0], [2.0, 3.0, 0, 0, 0]])
    codes_b = torch.tensor([[0.0, 0, 4.0, 0, 0], [0.0, 0, 0, 0, 0]])
    assert l0(codes_a) == 1.5 and l0(codes_b) == 0.5
    assert dead_fraction([codes_a, codes_b]) == pytest.approx(2 / 5)
    activity = np.array([[0.5, 0.2, 0.0, 0.3, 0.0], [0.4, 0.0, 0.9, 0.01, 0.0]])
    assert shared_unique(activity) == ConceptOverlap(shared=2, unique=[1, 1], dead=1, alive=4)
    assert shared_unique(activity, threshold=0.1) == ConceptOverlap(shared=1, unique=[2, 1], dead=1, alive=4)
    assert concept_mask("unique", 0, activity).tolist() == [False, True, False, False, False]
    assert concept_mask("shared", 1, activity).tolist() == [True, False, False, True, False]
    with pytest.raises(ValueError, match=r"needs the activity matrix"):
        concept_mask("shared", 0)
    with pytest.raises(ValueError, match=r"got 'shard'"):
        concept_mask("shard", 0, activity)


def test_calibrated_rule_sets_rarely_firing_unique_concepts_apart():
    assert min_unique_count(10) == 8  # 0.5**8 <= 0.05 / 10 < 0.5**7
    assert min_unique_count(2 * 1024) == 16
    counts = np.array([[100, 3, 0, 50, 0], [0, 0, 0, 40, 1]])  # 10 tests: unique needs 8 firings
    overlap, minimum = calibrated_overlap(counts)
    assert minimum == 8
    assert overlap == ConceptOverlap(shared=1, unique=[1, 0], dead=1, alive=4, too_rare=2)
    assert overlap.overlap == 0.5 and shared_unique(counts).overlap == 0.25


def test_models_with_identical_firing_rates_share_99_percent_under_the_calibrated_rule():
    """Two identical models: each concept fires at the same rate in both, many of them about
    once in 49,000 tokens, so which of the two a rare concept happens to fire in is chance."""
    rng = np.random.default_rng(0)
    rates = 10 ** rng.uniform(-5, -1, 1024)
    counts = rng.binomial(49_000, rates, size=(2, 1024))
    assert shared_unique(counts).overlap < 0.95  # fires once: chance single firings look unique
    overlap, _ = calibrated_overlap(counts)
    assert overlap.overlap >= 0.99 and overlap.too_rare > 50


def test_finish_from_layer_with_the_true_tokens_is_the_model(trained_cnn):
    trained_cnn, data = trained_cnn
    x = data.x_test[:6]
    tokens = collect_tokens([trained_cnn], "conv2", x)[0]
    finish = finish_from_layer(trained_cnn, "conv2", x)
    with torch.no_grad():
        assert torch.allclose(finish(tokens), trained_cnn(x), atol=1e-5)
        assert not torch.allclose(finish(torch.zeros_like(tokens)), trained_cnn(x))
    assert all(not m._forward_hooks for m in trained_cnn.modules())


def test_stitching_identical_models_keeps_the_models_accuracy(trained_cnn):
    trained_cnn, data = trained_cnn
    models = [trained_cnn, copy.deepcopy(trained_cnn)]
    tokens = collect_tokens(models, "conv2", data.x_train)
    cfg = USAEConfig(dict_size=32, k=8, epochs=15, batch_size=256, lr=1e-2)
    usae, _ = train_usae(InMemorySource(tokens), cfg)
    x, y = data.x_test, data.y_test
    test_tokens = collect_tokens(models, "conv2", x)
    stitch = stitch_accuracy(usae, 0, 1, test_tokens, finish_from_layer(models[1], "conv2", x), y)
    own = float((trained_cnn(x).argmax(1) == y).float().mean())
    assert stitch.own_accuracy == pytest.approx(own) and own > 0.5
    assert stitch.accuracy >= own - 0.1 and stitch.percent_of_own >= 85
    finish = finish_from_layer(models[1], "conv2", x)
    empty = stitch_accuracy(usae, 0, 1, test_tokens, finish, y, concepts=np.zeros(32, bool))
    assert (empty + stitch).total == 2 * len(y) and empty.own_correct == stitch.own_correct
