"""FedAvg aggregation with mocked client replies, the weighted mean, and weight files."""

from __future__ import annotations

import numpy as np
import pytest

from fedmech_flwr.api.strategy import FedAvgConfig, WeightedFedAvg
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.strategy import STRATEGIES
from fedmech_flwr.contracts.strategy import weighted_fedavg as fedavg
from fedmech_flwr.learning.arrays import from_record, load_arrays, save_arrays, weighted_mean

NUM_EXAMPLES = [10, 30, 60]


def client_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(size=(4, 1, 3, 3)).astype(np.float32),
        "head.bias": rng.normal(size=(5,)).astype(np.float64),
        "bn.num_batches_tracked": np.array(rng.integers(0, 100), dtype=np.int64),
    }


@pytest.fixture
def replies(messages):
    models = [client_arrays(i) for i in range(3)]
    metrics = [{"train-loss": 1.0, "train-accuracy": 0.2}, {"train-loss": 2.0, "train-accuracy": 0.5},
               {"train-loss": 4.0, "train-accuracy": 0.9}]
    msgs = [messages.train(1000 + i, models[i], NUM_EXAMPLES[i], metrics[i]) for i in range(3)]
    return models, metrics, msgs


def test_examples_weighting_equals_hand_computed_mean(replies):
    models, _, msgs = replies
    arrays, _ = WeightedFedAvg(weighting="examples").aggregate_train(1, msgs)
    got = from_record(arrays)
    assert list(got) == list(models[0])  # names and order kept
    for name in ("conv.weight", "head.bias"):
        expected = (10 * models[0][name].astype(np.float64) + 30 * models[1][name] + 60 * models[2][name]) / 100
        assert got[name].dtype == models[0][name].dtype
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=1e-6)


def test_uniform_weighting_equals_plain_mean(replies):
    models, _, msgs = replies
    arrays, _ = WeightedFedAvg(weighting="uniform").aggregate_train(1, msgs)
    got = from_record(arrays)
    for name in ("conv.weight", "head.bias"):
        expected = np.mean([m[name].astype(np.float64) for m in models], axis=0)
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=1e-6)
    # ... and differs from the examples-weighted mean on this data
    weighted = from_record(WeightedFedAvg(weighting="examples").aggregate_train(1, msgs)[0])
    assert not np.allclose(weighted["conv.weight"], got["conv.weight"], atol=1e-3)


def test_start_up_log_says_how_the_average_is_weighted(caplog):
    with caplog.at_level("INFO", logger="fedmech_flwr.contracts.strategy"):
        WeightedFedAvg(weighting="uniform").summary()
    assert "model weights uniform (1 per client); train metrics weighted by 'num-examples'" in caplog.text
    assert "Weighted by" not in caplog.text  # Flower's line, true only of examples weighting
    caplog.clear()
    with caplog.at_level("INFO", logger="fedmech_flwr.contracts.strategy"):
        WeightedFedAvg(weighting="examples").summary()
    assert "model weights weighted by 'num-examples'" in caplog.text

    class Median(WeightedFedAvg):  # a rule of its own, as fedmech new writes
        def average(self, server_round, contents, models, weights):
            return models[0], {}

    caplog.clear()
    with caplog.at_level("INFO", logger="fedmech_flwr.contracts.strategy"):
        Median().summary()
    assert "model weights Median.average;" in caplog.text


def test_int_buffer_stays_int_and_is_rounded(messages):
    counts = [np.array(3, dtype=np.int64), np.array(4, dtype=np.int64), np.array(10, dtype=np.int64)]
    msgs = [
        messages.train(1000 + i, {"w": np.full(2, float(i), np.float32), "n": counts[i]}, n)
        for i, n in enumerate([1, 1, 2])
    ]
    got = from_record(WeightedFedAvg().aggregate_train(1, msgs)[0])
    assert got["n"].dtype == np.int64 and got["n"].shape == ()  # like BatchNorm's counter
    assert got["n"].item() == 7  # (3 + 4 + 2 * 10) / 4 = 6.75 -> 7
    np.testing.assert_allclose(got["w"], [1.25, 1.25])  # (0 + 1 + 2 * 2) / 4
    assert got["w"].dtype == np.float32


def test_metrics_are_weighted_by_examples(replies):
    _, metrics, msgs = replies
    _, agg = WeightedFedAvg(weighting="examples").aggregate_train(1, msgs)
    assert "num-examples" not in agg
    assert agg["train-loss"] == pytest.approx((10 * 1.0 + 30 * 2.0 + 60 * 4.0) / 100)
    assert agg["train-accuracy"] == pytest.approx((10 * 0.2 + 30 * 0.5 + 60 * 0.9) / 100)


def test_error_replies_are_skipped(replies, messages):
    models, _, msgs = replies
    arrays, _ = WeightedFedAvg().aggregate_train(1, [msgs[0], messages.error(1001), msgs[2]])
    expected = (10 * models[0]["head.bias"] + 60 * models[2]["head.bias"]) / 70
    np.testing.assert_allclose(from_record(arrays)["head.bias"], expected, atol=1e-6)


def test_no_valid_replies_gives_none(messages):
    assert WeightedFedAvg().aggregate_train(1, [messages.error(1000)]) == (None, None)
    assert WeightedFedAvg().aggregate_train(1, []) == (None, None)


def test_registered_factory_trains_every_offered_node():
    plugins.load()
    assert "fedavg" in STRATEGIES
    strategy = STRATEGIES.get("fedavg").factory(FedAvgConfig(weighting="uniform"), None)
    assert isinstance(strategy, WeightedFedAvg) and strategy.weighting == "uniform"
    assert strategy.fraction_train == 1.0 and strategy.fraction_evaluate == 0.0
    assert strategy.min_train_nodes == 1 and strategy.min_available_nodes == 1
    assert fedavg(FedAvgConfig(), None).weighting == "examples"


# --- weighted_mean ----------------------------------------------------------------------

def test_record_round_trip_keeps_shapes_and_dtypes(replies):
    models, _, msgs = replies
    from fedmech_flwr.learning.arrays import to_record

    back = from_record(to_record(models[0]))
    assert {k: (v.shape, v.dtype) for k, v in back.items()} == {k: (v.shape, v.dtype) for k, v in models[0].items()}
    transposed = np.arange(6.0).reshape(2, 3).T  # not C-contiguous
    np.testing.assert_array_equal(from_record(to_record({"t": transposed}))["t"], transposed)


def test_weighted_mean_known_answer():
    a = {"x": np.array([0.0, 2.0], np.float32)}
    b = {"x": np.array([4.0, 6.0], np.float32)}
    np.testing.assert_allclose(weighted_mean([a, b], [1, 3])["x"], [3.0, 5.0])
    np.testing.assert_allclose(weighted_mean([a], [5])["x"], a["x"])


@pytest.mark.parametrize(("models", "weights"), [([], []), ([{"x": np.zeros(1)}], [1, 2]), ([{"x": np.zeros(1)}] * 2, [1])])
def test_weighted_mean_mismatched_lengths(models, weights):
    with pytest.raises(ValueError, match="need one weight per model"):
        weighted_mean(models, weights)


@pytest.mark.parametrize("weights", [[0, 0], [0.0, 0.0], [1, -1]])
def test_weighted_mean_zero_weights(weights):
    with pytest.raises(ValueError, match="weights must sum to a positive number"):
        weighted_mean([{"x": np.zeros(1)}, {"x": np.ones(1)}], weights)


# --- weight files -----------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    arrays = client_arrays(0)
    path = tmp_path / "sub" / "w.safetensors"
    save_arrays(path, arrays, {"round": "3"})
    back = load_arrays(path)
    assert sorted(back) == sorted(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
    assert [p.name for p in path.parent.iterdir()] == ["w.safetensors"]  # no temp file left


def test_truncated_file_gives_clear_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_arrays(path, client_arrays(0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is not a readable safetensors file .* truncated or foreign") as info:
        load_arrays(path)
    assert str(path) in str(info.value)


def test_foreign_file_gives_clear_error(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04 this is a zip/pickle, not safetensors" * 4)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_arrays(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights file at"):
        load_arrays(tmp_path / "nope.safetensors")
