"""The misalignment diagnostic: known answers on a model whose head is scrambled, its
observe-only contract, its checks on bad input, and an in-process run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import rolled_head, small_cnn
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.diagnostics.misalignment import (
    LEARNING_CURVE,
    OUTPUTS,
    UNDER_POWERED_GAIN,
    Misalignment,
    MisalignmentConfig,
    _nested_shares,
    check_misalignment,
    degenerate_heads,
    fit_probe,
)
from fedmech_flwr.builtin.diagnostics.misalignment_table import skew_gaps, table, table_row
from fedmech_flwr.contracts.hooks import ClientUpdate, GlobalContext, RoundState
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, load_model_arrays, model_arrays
from fedmech_flwr.learning.heads import LinearTrainConfig, balanced_split
from fedmech_flwr.tools.cli import main

NUM_CLASSES = 4
FAST_HEAD = LinearTrainConfig(epochs=20, batch_size=16, lr=0.05, weight_decay=0.0)


def round_state(arrays: NamedArrays, data, clients=None) -> RoundState:
    audit, _ = balanced_split(data.y_train, 80, NUM_CLASSES, torch.Generator().manual_seed(0))

    def build(a: NamedArrays):
        m = small_cnn()
        load_model_arrays(m, a)
        return m.eval()

    datasets = {"test": (data.x_test, data.y_test), "audit": (data.x_train[audit], data.y_train[audit])}
    return RoundState(3, arrays, arrays, clients or {}, datasets, NUM_CLASSES, build, torch.device("cpu"), 0)


def digest(arrays: NamedArrays) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode() + np.ascontiguousarray(arrays[key]).tobytes())
    return h.hexdigest()


def test_scrambled_head_perfect_features_probe_and_realignment_recover(separable_cnn):
    model, data = separable_cnn
    diag = Misalignment(MisalignmentConfig(head_samples=40, head=FAST_HEAD))
    metrics = diag.server_side(round_state(rolled_head(model_arrays(model)), data)).metrics
    assert metrics["global"]["accuracy"] < 0.05
    assert metrics["probe"]["accuracy"] > 0.95
    assert metrics["realigned"]["accuracy"] > 0.95
    assert metrics["gaps"]["probe"] == pytest.approx(metrics["probe"]["accuracy"] - metrics["global"]["accuracy"])
    assert all(g > 0.8 for g in metrics["per_class_gaps"]["realigned"])
    assert metrics["realigned_test_selected"]["accuracy"] >= metrics["realigned"]["accuracy"]
    assert "test set" in metrics["realigned_test_selected"]["note"]
    assert metrics["split"] == {"train": 256, "validation": 64, "head": 40}
    assert metrics["tau_norm"]["accuracy"] < 0.2  # rescaling rows cannot undo a permutation


def test_the_paper_recipe_barely_moves_a_scrambled_head(separable_cnn):
    """65 AdamW steps at lr 1e-3 are a small nudge: the default head recipe measures how
    far the head is from reading the features, it cannot rebuild a permuted head."""
    model, data = separable_cnn
    metrics = Misalignment(MisalignmentConfig(head_samples=40)).server_side(round_state(rolled_head(model_arrays(model)), data)).metrics
    assert metrics["realigned"]["accuracy"] < 0.5 < metrics["probe"]["accuracy"]


def test_client_statistics_give_ncm_and_ccvr_heads(separable_cnn):
    model, data = separable_cnn
    arrays = rolled_head(model_arrays(model))
    diag = Misalignment(MisalignmentConfig(head_samples=40, client_stats=["ncm", "ccvr"], ccvr_covariance="full"))
    assert diag.needs_global_pass() and not Misalignment(MisalignmentConfig()).needs_global_pass()
    clients = {}
    for partition_id, classes in enumerate([(0, 1), (2, 3)]):  # each client holds two classes
        keep = (data.y_train == classes[0]) | (data.y_train == classes[1])
        model = round_state(arrays, data).build_model(arrays)
        ctx = GlobalContext(3, partition_id, model, data.x_train[keep], data.y_train[keep],
                            NUM_CLASSES, torch.device("cpu"), seed=0)
        update = ClientUpdate(partition_id, arrays, int(keep.sum()), {})
        update.global_diagnostics = {"misalignment": diag.client_side_global(ctx)}
        clients[partition_id] = update
    metrics = diag.server_side(round_state(arrays, data, clients)).metrics
    assert metrics["ncm"]["accuracy"] > 0.95 and metrics["ncm"]["clients"] == 2
    assert metrics["ccvr"]["accuracy"] > 0.9


def test_diagnostic_never_changes_the_weights(separable_cnn):
    model, data = separable_cnn
    arrays = rolled_head(model_arrays(model))
    before = digest(arrays)
    state = round_state(arrays, data, {0: ClientUpdate(0, rolled_head(model_arrays(model)), 10, {})})
    diag = Misalignment(MisalignmentConfig(head_samples=40, probe_clients=True, probe_layers=["conv1"],
                                           client_stats=["ncm"]))
    ctx = GlobalContext(3, 0, state.build_model(arrays), data.x_train, data.y_train, NUM_CLASSES, torch.device("cpu"), 0)
    state.clients[0].global_diagnostics = {"misalignment": diag.client_side_global(ctx)}
    metrics = diag.server_side(state).metrics
    assert digest(arrays) == before and digest(state.clients[0].arrays) == before
    assert set(metrics["layers"]) == {"conv1"} and set(metrics["clients"]) == {"0"}
    assert metrics["clients"]["0"]["own_head"]["accuracy"] < 0.05


@pytest.mark.parametrize(
    ("params", "audit_per_class", "match"),
    [
        ({"head_samples": 3}, 50, "3 samples must be at least the number of classes \\(4\\).*diagnostics\\[0\\]\\.head_samples"),
        ({}, 0, "set data.audit_per_class"),
        ({"head_samples": 200}, 50, "needs 50 per class, but the audit set has 40 per class to spare"),
        ({"validation_fraction": 0.1}, 4, "leaves none to select epochs on"),
    ],
)
def test_bad_input_is_refused_before_the_run(params, audit_per_class, match):
    data = DataInfo(torch.arange(400) % NUM_CLASSES, 100, NUM_CLASSES, (1, 8, 8), audit_per_class)
    with pytest.raises(ConfigError, match=match):
        check_misalignment(MisalignmentConfig(**params), None, data, "diagnostics[0]")


def test_in_process_run_records_the_table_and_plots(make_cfg, tmp_path, capsys, smoke_run):
    cfg = make_cfg(
        "data.audit_per_class=15",
        "diagnostics=[{name: misalignment, head_samples: 20, client_stats: [ncm, ccvr]}]",
    )
    run = run_in_process(cfg, tmp_path)
    records = read_records(run, "diagnostic")
    assert [r["round"] for r in records] == [1, 2]
    for key in ("global", "probe", "realigned", "realigned_test_selected", "tau_norm", "ncm", "ccvr"):
        assert 0.0 <= records[-1][key]["accuracy"] <= 1.0
        assert len(records[-1][key]["per_class"]) == 4
    evals = read_records(run, "eval")
    assert records[-1]["global"]["accuracy"] == pytest.approx(evals[-1]["accuracy"])
    for name in ("misalignment_accuracy.png", "misalignment_gap_probe.png", "misalignment_gap_realigned.png"):
        assert (run / "plots" / name).is_file()

    assert main(["misalignment-table", str(run), "--round", "1"]) == 0
    header, rule, row = capsys.readouterr().out.strip().splitlines()[:3]
    assert "| probe (%) |" in header and "| realigned − global (pp) |" in header and rule.startswith("|---|")
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert cells["round"] == "1" and cells["partition"] == "dirichlet(alpha=0.5, min_samples=10, max_attempts=100)"
    assert cells["strategy"] == "fedavg(weighting=examples)"
    assert float(cells["probe (%)"].split()[0]) == pytest.approx(100 * records[0]["probe"]["accuracy"], abs=0.05)
    assert 0.0 < records[-1]["global"]["max_predicted_fraction"] <= 1.0
    assert main(["misalignment-table", str(run), "--round", "9"]) == 2
    assert "no misalignment record at round 9: it has them for rounds 1 to 2" in capsys.readouterr().err
    assert main(["misalignment-table", str(smoke_run)]) == 2  # a run without the diagnostic
    assert "has no misalignment records" in capsys.readouterr().err

    # an IID run of the same settings: each gap minus the IID run's gap of the same round
    iid = tmp_path / "iid-copy"
    shutil.copytree(run, iid)
    config = yaml.safe_load((iid / "config.yaml").read_text())
    config["data"]["partition"], config["name"] = {"name": "iid"}, "iid-copy"
    (iid / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [json.loads(line) for line in (iid / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if r.get("name") == "misalignment":
            r["gaps"] = {"probe": 0.125, "realigned": -0.25}
    (iid / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, notes = table([run, iid], None)
    assert rows[0]["IID baseline"] == "iid-copy" and rows[1]["IID baseline"] == "-"
    assert rows[0]["probe gap beyond IID (pp)"] == f"{100 * (records[-1]['gaps']['probe'] - 0.125):+.1f}"
    assert rows[0]["realigned gap beyond IID (pp)"] == f"{100 * (records[-1]['gaps']['realigned'] + 0.25):+.1f}"
    assert any("gap beyond IID" in note for note in notes)


def test_skew_attributable_gap_is_the_gap_minus_the_iid_gap():
    record = {"gaps": {"probe": 0.254, "realigned": 0.055}}
    iid = {"gaps": {"probe": 0.136, "realigned": -0.009}}
    assert skew_gaps(record, iid) == {"probe": pytest.approx(0.118), "realigned": pytest.approx(0.064)}


def test_a_head_that_predicts_one_class_is_flagged(separable_cnn, caplog):
    model, data = separable_cnn
    arrays = model_arrays(model)
    arrays["head.weight"] = np.zeros_like(arrays["head.weight"])  # the head says class 1, always
    arrays["head.bias"] = np.eye(NUM_CLASSES, dtype=arrays["head.bias"].dtype)[1]
    with caplog.at_level("INFO", logger="fedmech_flwr.builtin.diagnostics.misalignment"):
        record = Misalignment(MisalignmentConfig(head_samples=40, head=FAST_HEAD)).server_side(
            round_state(arrays, data)).metrics
    assert record["global"]["max_predicted_class"] == 1 and record["global"]["max_predicted_fraction"] == 1.0
    assert record["probe"]["max_predicted_fraction"] < 0.5  # the features still separate the classes
    assert "global" in degenerate_heads(record) and "probe" not in degenerate_heads(record)
    assert "degenerate head(s), one class for > 90% of the test images: global (class 1: 100%)" in caplog.text
    row = table_row(Path("run"), {"data": {"partition": {"name": "iid"}}, "strategy": {"name": "fedavg"},
                                  "client": {"name": "plain"}}, {**record, "round": 3})
    assert row["global (%)"] == f"{100 * record['global']['accuracy']:.1f} ⚑ one class"
    assert "⚑ one class" in row["probe − global (pp)"]  # a gap against a one-class head
    assert "one class" not in row["probe (%)"]


def test_a_run_without_an_audit_set_fails_before_its_folder_exists(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="audit_per_class.* in .*smoke.yaml: diagnostics\\[0\\]"):
        run_in_process(make_cfg("diagnostics=[{name: misalignment, head_samples: 20}]"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_audit_set_that_overlaps_the_test_set_is_refused(make_cfg, tmp_path, monkeypatch):
    import fedmech_flwr.app.experiment_run as server

    real = server.load_data

    def leaky(cfg):  # a dataset whose test split is copied from its training split
        bundle = real(cfg)
        return dataclasses.replace(bundle, x_test=bundle.x_train[:100], y_test=bundle.y_train[:100])

    monkeypatch.setattr(server, "load_data", leaky)
    cfg = make_cfg("data.audit_per_class=20")
    with pytest.raises(ConfigError, match="audit set shares .* image\\(s\\) with the test set"):
        run_in_process(cfg, tmp_path)
    assert not any(tmp_path.iterdir())


def test_the_pooled_probe_trains_on_every_clients_data_and_says_it_is_an_oracle(separable_cnn):
    model, data = separable_cnn
    state = round_state(rolled_head(model_arrays(model)), data)
    state.datasets["pooled"] = (data.x_train, data.y_train)
    pooled_of = {}
    for recipe in ("selected", "paper"):
        diag = Misalignment(MisalignmentConfig(head_samples=40, head=FAST_HEAD, pooled_probe=recipe,
                                               pooled_train=FAST_HEAD))
        assert diag.needs_pooled_data()
        metrics = diag.server_side(state).metrics
        pooled = pooled_of[recipe] = metrics["probe_pooled"]
        assert pooled["recipe"] == recipe and pooled["samples"] == 400 and "simulation-only" in pooled["note"]
        assert pooled["gap"] == pytest.approx(pooled["accuracy"] - metrics["global"]["accuracy"])
        assert len(pooled["per_class_gap"]) == NUM_CLASSES
        held_out = 0 if recipe == "paper" else 40  # selected: a tenth of the pooled data picks the epoch
        quarter, half, whole = pooled["learning_curve"]["samples"]  # per class, rounded
        assert whole == 400 - held_out and abs(half - whole / 2) <= NUM_CLASSES and abs(quarter - whole / 4) <= NUM_CLASSES
    assert pooled_of["selected"]["accuracy"] > 0.95 and pooled_of["selected"]["epoch"] >= 1
    assert "epoch" not in pooled_of["paper"]  # the authors' probe: its last epoch, none selected
    assert not Misalignment(MisalignmentConfig()).needs_pooled_data()


def test_the_pooled_probe_refuses_a_server_without_its_clients_data(separable_cnn):
    model, data = separable_cnn
    diag = Misalignment(MisalignmentConfig(head_samples=40, head=FAST_HEAD, pooled_probe="selected"))
    with pytest.raises(ConfigError, match="pooled_probe needs every client's training data"):
        diag.server_side(round_state(model_arrays(model), data))


def test_learning_curve_shares_are_nested_and_keep_every_class():
    y = torch.tensor([0] * 40 + [1] * 20 + [2] * 8)
    shares = _nested_shares(y, LEARNING_CURVE, torch.Generator().manual_seed(1))
    assert [len(s) for s in shares] == [10 + 5 + 2, 20 + 10 + 4, 68]
    assert set(shares[0].tolist()) <= set(shares[1].tolist()) <= set(shares[2].tolist())
    assert torch.bincount(y[shares[0]]).tolist() == [10, 5, 2]


def test_a_probe_that_still_gains_from_more_data_is_flagged_under_powered():
    """Known answers: two classes far apart along every one of two dimensions teach a probe
    all it can learn from a quarter of 100 images a class; classes 0.15 apart along each of
    200 dimensions, 50 images a class, still gain from every doubling (the probe overfits
    its noise when it has few images)."""
    g = torch.Generator().manual_seed(0)

    def sample(n_per_class, dims, shift):
        y = torch.arange(2).repeat_interleave(n_per_class)
        return torch.randn(len(y), dims, generator=g) + shift * (2 * y - 1)[:, None], y

    cfg = LinearTrainConfig(epochs=30, batch_size=32, lr=1e-2, weight_decay=0.0)
    easy = fit_probe(*sample(100, 2, 4.0), *sample(50, 2, 4.0), *sample(200, 2, 4.0), 2, cfg, seed=0)
    assert easy["learning_curve"]["accuracy"][-1] > 0.99 and easy["under_powered"] is False
    hard = fit_probe(*sample(50, 200, 0.15), *sample(50, 200, 0.15), *sample(500, 200, 0.15), 2, cfg, seed=0)
    curve = hard["learning_curve"]["accuracy"]
    assert curve[-1] - curve[-2] > UNDER_POWERED_GAIN and hard["under_powered"] is True
    assert hard["accuracy"] == curve[-1]


def test_an_under_powered_probe_is_flagged_beside_a_one_class_head():
    probe, gap = OUTPUTS.metrics["probe"], OUTPUTS.metrics["gaps.probe"]
    record = {"global": {"max_predicted_fraction": 0.95}, "probe": {"max_predicted_fraction": 0.2, "under_powered": True}}
    assert probe.flag(record) == "under-powered"
    assert gap.flag(record) == "one class; under-powered"
    record["probe"]["under_powered"] = False
    assert probe.flag(record) is None and gap.flag(record) == "one class"


def test_a_run_keeps_the_checkpoints_of_its_diagnosed_rounds_and_the_pooled_probe(make_cfg, tmp_path):
    cfg = make_cfg("data.audit_per_class=15", "federation.checkpoint_every=5",
                   "diagnostics=[{name: misalignment, head_samples: 20, rounds: [1], pooled_probe: selected}]")
    run = run_in_process(cfg, tmp_path)
    record, = read_records(run, "diagnostic")
    assert record["round"] == 1 and record["probe_pooled"]["samples"] == sum(
        r["num_samples"] for r in json.loads((run / "partitions.json").read_text())["clients"])
    assert sorted(p.name for p in (run / "checkpoints").glob("round_*")) == ["round_001.safetensors",
                                                                            "round_002.safetensors"]
