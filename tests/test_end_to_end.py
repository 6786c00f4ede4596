"""Whole experiments run in process on the synthetic smoke config: the run folder, its
reproducibility, sampling, failures, bad input, diagnostics and the pruning policy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import run_folders, smoke_config, without_measured
from faults import Fault, faulty_app
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.app.protocol import ClientFailure, RoundProtocol
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.contracts.hooks import DIAGNOSTICS, ClientUpdate, RoundState
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, load_arrays, load_model_arrays, model_arrays
from fedmech_flwr.learning.training import evaluate
from fedmech_flwr.spec.experiment import load_data, new_model, parse_experiment

CLIENTS, ROUNDS, CLASSES = 3, 2, 4
def final_weights(run: Path) -> NamedArrays:
    return load_arrays(run / "model_final.safetensors")


# --- the run folder of one run ----------------------------------------------------------

def test_run_folder_files(smoke_run, smoke_cfg):
    run = smoke_run
    assert read_status(run)["status"] == "completed"
    assert run.name.startswith("smoke-")
    assert parse_experiment(yaml.safe_load((run / "config.yaml").read_text()), "config.yaml") == smoke_cfg

    env = json.loads((run / "environment.json").read_text())
    assert env["seed"] == 0 and env["device"] == "cpu"
    assert env["packages"]["flwr"].startswith("1.42")
    assert set(env["git"]) == {"commit", "dirty"}
    assert env["git"]["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git"]["commit"])


def test_partitions_file(smoke_run, smoke_cfg):
    parts = json.loads((smoke_run / "partitions.json").read_text())
    assert parts["num_clients"] == CLIENTS
    assert parts["class_names"] == [f"class {i}" for i in range(CLASSES)]
    clients = parts["clients"]
    assert [c["partition_id"] for c in clients] == [0, 1, 2]
    for c in clients:
        assert sum(c["label_histogram"]) == c["num_samples"] >= 10  # min_samples
    # dirichlet hands out every training sample; the synthetic set is balanced (75 per class)
    assert sum(c["num_samples"] for c in clients) == 300
    assert np.sum([c["label_histogram"] for c in clients], axis=0).tolist() == [75] * CLASSES
    bundle = load_data(smoke_cfg)
    assert np.bincount(bundle.y_train.numpy()).tolist() == [75] * CLASSES


def test_metrics_records(smoke_run, smoke_cfg):
    records = read_records(smoke_run)
    assert {r["kind"] for r in records} == {"eval", "client", "diagnostic", "strategy"}
    aggregates = read_records(smoke_run, "strategy")  # the aggregate's MetricRecord, a round each
    assert [r["round"] for r in aggregates] == list(range(1, ROUNDS + 1))
    assert all(r["aggregate_seconds"] >= 0 and r["train_loss"] > 0 for r in aggregates)
    evals = read_records(smoke_run, "eval")
    assert [r["round"] for r in evals] == list(range(ROUNDS + 1))
    for r in evals:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0
        assert len(r["per_class_accuracy"]) == CLASSES
        assert set(r["layer_sparsity"]) == {"conv1.weight", "conv2.weight", "head.weight"}
        assert r["clients_sampled"] == r["clients_succeeded"] == ([] if r["round"] == 0 else [0, 1, 2])
        assert r["server_peak_rss_mb"] > 10  # the server process's peak RSS so far
    assert evals[0]["sparsity"] == 0.0  # the initial model is dense

    clients = read_records(smoke_run, "client")
    assert sorted((r["round"], r["partition_id"]) for r in clients) == [
        (rnd, p) for rnd in range(1, ROUNDS + 1) for p in range(CLIENTS)
    ]
    sizes = [c["num_samples"] for c in json.loads((smoke_run / "partitions.json").read_text())["clients"]]
    for r in clients:
        per_class = r["local_per_class_accuracy"]
        assert isinstance(per_class, list) and len(per_class) == CLASSES
        assert all(v is None or 0.0 <= v <= 1.0 for v in per_class)
        assert isinstance(r["layer_sparsity"], dict)
        assert set(r["layer_sparsity"]) == {"conv1.weight", "conv2.weight", "head.weight"}
        assert r["layer_sparsity"]["head.weight"] == 0.0  # include_head: false
        assert r["num_examples"] == smoke_cfg.train.epochs * sizes[r["partition_id"]]
        assert r["sparsity"] >= 0.9 - 0.01  # clients reach the target within a round

    diags = read_records(smoke_run, "diagnostic")
    assert [(r["round"], r["name"]) for r in diags] == [(rnd, "weight_divergence") for rnd in range(1, ROUNDS + 1)]
    for r in diags:
        assert set(r["clients"]) == {"0", "1", "2"}
        assert r["layers"] == ["conv1.weight", "conv2.weight", "head.weight"]
        for entry in r["clients"].values():
            assert entry["relative_distance"] > 0 and 0 <= entry["support_iou"] <= 1
    stored = load_arrays(smoke_run / "diagnostics" / "weight_divergence" / "round_002.safetensors")
    assert stored["relative_distance"].shape == (CLIENTS, 3)
    assert stored["partition_ids"].tolist() == [0, 1, 2]


def test_checkpoints_and_final_model_reproduce_final_eval(smoke_run, smoke_cfg):
    ckpts = sorted(p.name for p in (smoke_run / "checkpoints").iterdir())
    assert ckpts == ["round_001.safetensors", "round_002.safetensors", "state"]
    # each numbered checkpoint keeps its round's state too (fedmech run --from-checkpoint)
    states = sorted(p.name for p in (smoke_run / "checkpoints" / "state").iterdir())
    assert states == ["round_001.safetensors", "round_002.safetensors"]
    final = final_weights(smoke_run)
    last = load_arrays(smoke_run / "checkpoints" / "round_002.safetensors")
    assert all(np.array_equal(final[k], last[k]) for k in final)
    first = load_arrays(smoke_run / "checkpoints" / "round_001.safetensors")
    assert not all(np.array_equal(final[k], first[k]) for k in final)

    bundle = load_data(smoke_cfg)
    model = new_model(smoke_cfg, bundle)
    assert sorted(final) == sorted(model.state_dict())  # safetensors files list names sorted
    load_model_arrays(model, final)
    res = evaluate(model, bundle.x_test, bundle.y_test, bundle.num_classes, smoke_cfg.eval_batch_size)
    last_eval = read_records(smoke_run, "eval")[-1]
    assert res.accuracy == last_eval["accuracy"]
    assert res.loss == pytest.approx(last_eval["loss"], rel=1e-5)


def test_tensorboard_holds_every_declared_metric_per_round(smoke_run):
    """The event files: each declared metric as a scalar per round (as shown: percent),
    per-class values, the flags TensorBoard cannot draw, the config and the plots."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(smoke_run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    evals = read_records(smoke_run, "eval")
    accuracy = events.Scalars("eval/accuracy")
    assert [e.step for e in accuracy] == [r["round"] for r in evals] == [0, 1, 2]
    assert [e.value for e in accuracy] == pytest.approx([100 * r["accuracy"] for r in evals], rel=1e-6)
    tags = events.Tags()
    assert {"weight_divergence/mean.update_cosine", "eval/sparsity"} <= set(tags["scalars"])
    assert {f"eval/accuracy per class/class {c}" for c in range(4)} <= set(tags["scalars"])
    assert {"config/text_summary", "flags/text_summary"} <= set(tags["tensors"])  # round 0: one class
    flagged = [e.step for e in events.Tensors("flags/text_summary")]
    assert flagged == [r["round"] for r in evals if r["max_predicted_fraction"] > 0.9]
    assert "plots/accuracy" in tags["images"]


def test_plots_exist(smoke_run):
    plots = {p.name for p in (smoke_run / "plots").glob("*.png")}
    expected = {"accuracy.png", "loss.png", "per_class_accuracy.png", "label_distribution.png", "sparsity.png"}
    assert expected <= plots
    assert {p for p in plots if p.startswith("weight_divergence_")} == {
        "weight_divergence_relative_distance.png", "weight_divergence_update_cosine.png",
        "weight_divergence_support_iou.png",
    }
    for name in plots:
        data = (smoke_run / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# --- reproducibility --------------------------------------------------------------------

def test_same_seed_reproduces_records_and_weights(smoke_run, tmp_path):
    again = run_in_process(smoke_config(), tmp_path)
    assert without_measured(read_records(again)) == without_measured(read_records(smoke_run))
    a, b = final_weights(smoke_run), final_weights(again)
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    assert (again / "partitions.json").read_text() == (smoke_run / "partitions.json").read_text()


def test_different_seed_differs(smoke_run, tmp_path):
    other = run_in_process(smoke_config(["seed=1"]), tmp_path)
    a, b = final_weights(smoke_run), final_weights(other)
    assert any(a[k].tobytes() != b[k].tobytes() for k in a)
    assert without_measured(read_records(other, "eval")) != without_measured(read_records(smoke_run, "eval"))


# --- sampling ---------------------------------------------------------------------------

def test_clients_per_round_samples_two_of_three(tmp_path):
    cfg = smoke_config(["federation.clients_per_round=2"])
    run = run_in_process(cfg, tmp_path)
    expected = RoundProtocol(None, cfg, {p: p for p in range(CLIENTS)}, None)
    clients = read_records(run, "client")
    evals = read_records(run, "eval")
    for rnd in range(1, ROUNDS + 1):
        trained = sorted(r["partition_id"] for r in clients if r["round"] == rnd)
        assert len(trained) == 2 and trained == expected.sample(rnd)
        assert evals[rnd]["clients_sampled"] == evals[rnd]["clients_succeeded"] == trained
    for r in read_records(run, "diagnostic"):
        assert len(r["clients"]) == 2


# --- client failures --------------------------------------------------------------------

def test_failure_with_fail_policy_stops_run(tmp_path):
    with pytest.raises(ClientFailure, match="round 2: client 1 failed \\(raised: RuntimeError: injected crash\\)"):
        run_in_process(smoke_config(), tmp_path, client_app=faulty_app(Fault("raise", 1, 2)))
    [run] = run_folders(tmp_path)
    status = read_status(run)
    assert status["status"] == "failed"
    assert "ClientFailure" in status["error"] and "client 1" in status["error"]
    assert "injected crash" in status["error"]
    failures = read_records(run, "failure")
    assert [(f["round"], f["partition_id"], f["policy"]) for f in failures] == [(2, 1, "fail")]
    assert not (run / "model_final.safetensors").exists()
    assert [r["round"] for r in read_records(run, "eval")] == [0, 1]


def test_failure_with_continue_policy_completes(tmp_path):
    cfg = smoke_config(["federation.on_client_failure=continue"])
    run = run_in_process(cfg, tmp_path, client_app=faulty_app(Fault("raise", 1, 2)))
    assert read_status(run)["status"] == "completed"
    failures = read_records(run, "failure")
    assert len(failures) == 1
    f = failures[0]
    assert (f["round"], f["partition_id"], f["policy"]) == (2, 1, "continue")
    assert (f["reason"], f["details"]) == ("raised: RuntimeError: injected crash", "logs/client_failures.log")
    assert (run / f["details"]).read_text().startswith("--- round 2, client 1, ")
    evals = read_records(run, "eval")
    assert evals[2]["clients_sampled"] == [0, 1, 2] and evals[2]["clients_succeeded"] == [0, 2]
    assert sorted(r["partition_id"] for r in read_records(run, "client") if r["round"] == 2) == [0, 2]
    assert (run / "model_final.safetensors").is_file()


# --- bad input leaves no run folder -----------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "error", "fragments"),
    [
        (["data.dataset={name: fashion_mnist, root: /nonexistent}"], ConfigError,
         ["fashion_mnist not found", "/nonexistent (no such directory)", "Nothing is downloaded"]),
        (["data.partition.alpha=0"], ConfigError, ["alpha must be > 0, got 0", "data.partition.alpha"]),
        (["data.partition.alpha=-1"], ConfigError, ["alpha must be > 0, got -1"]),
        (["data.dataset.num_train=5", "federation.num_clients=10"], ConfigError,
         ["number of training samples (5), got 10"]),
        (["model.name=simple_cnm"], ConfigError, ["unknown model 'simple_cnm'", "did you mean 'simple_cnn'"]),
        (["model.channels=[4, 8, 8, 8]"], ConfigError, ["image_size 12 is too small for 4 conv blocks"]),
    ],
)
def test_bad_input_leaves_no_run_folder(tmp_path, overrides, error, fragments):
    out = tmp_path / "runs"
    with pytest.raises(error) as info:
        run_in_process(smoke_config(overrides), out)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert run_folders(out) == []


# --- weight divergence ------------------------------------------------------------------

def round_state(cfg, clients: dict[int, NamedArrays], global_arrays, previous) -> RoundState:
    bundle = load_data(cfg)

    def build(arrays):
        m = new_model(cfg, bundle)
        load_model_arrays(m, arrays)
        return m.eval()

    updates = {p: ClientUpdate(p, a, 10, {}) for p, a in clients.items()}
    return RoundState(1, global_arrays, previous, updates, {"test": (bundle.x_test, bundle.y_test)},
                      bundle.num_classes, build, torch.device("cpu"), 0)


def perturbed(arrays: NamedArrays, seed: int, scale: float = 0.1) -> NamedArrays:
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in arrays.items()}


def test_weight_divergence_known_answers(smoke_cfg):
    bundle = load_data(smoke_cfg)
    previous = model_arrays(new_model(smoke_cfg, bundle))
    global_arrays = perturbed(previous, 1)
    far = {k: 2 * v for k, v in global_arrays.items()}
    state = round_state(smoke_cfg, {0: global_arrays, 1: far}, global_arrays, previous)
    result = DIAGNOSTICS.get("weight_divergence").factory(smoke_cfg.diagnostics[0].params).server_side(state)
    same, double = result.metrics["clients"]["0"], result.metrics["clients"]["1"]
    assert same["relative_distance"] == 0.0
    assert same["support_iou"] == 1.0
    assert same["update_cosine"] == pytest.approx(1.0)
    assert double["relative_distance"] == pytest.approx(1.0)  # ||2g - g|| / ||g||
    assert double["support_iou"] == 1.0  # 2g has g's support
    assert result.arrays["partition_ids"].tolist() == [0, 1]
    np.testing.assert_allclose(result.arrays["relative_distance"][0], 0.0)
    np.testing.assert_allclose(result.arrays["relative_distance"][1], 1.0, rtol=1e-6)


# --- pruning policy ---------------------------------------------------------------------

def test_server_reprune_restores_target_sparsity(tmp_path):
    run = run_in_process(smoke_config(["pruning.server_reprune=true"]), tmp_path)
    for r in read_records(run, "eval")[1:]:
        assert r["sparsity"] >= 0.9 - 0.01
        assert r["layer_sparsity"]["conv2.weight"] >= 0.9 - 0.01
        assert r["layer_sparsity"]["head.weight"] == 0.0


def test_without_reprune_global_model_is_denser_than_clients(smoke_run, smoke_cfg):
    assert smoke_cfg.pruning.server_reprune is False
    clients = read_records(smoke_run, "client")
    for r in read_records(smoke_run, "eval")[1:]:
        client_sparsity = [c["sparsity"] for c in clients if c["round"] == r["round"]]
        # FedAvg of differently-pruned clients keeps the union of their supports
        assert r["sparsity"] < min(client_sparsity)
