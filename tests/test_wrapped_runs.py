"""Wrapped models in a real run (in process): a torchvision ResNet-18 and a user's MLP (also
under matched_avg and circuit_masked_avg), one round each with the circuits and
misalignment diagnostics on, pruning included."""

from __future__ import annotations

import pytest

from conftest import REPO
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.contracts import plugins
from fedmech_flwr.spec.experiment import load_experiment
from test_models import user_mlp  # noqa: F401  (registers user_mlp)

TINY = [  # batches of 30: no client's last batch holds one image, which BatchNorm cannot train on at 1x1
    "federation.num_rounds=1", "data.audit_per_class=10", "train.epochs=1", "train.batch_size=30",
    "diagnostics=[{name: circuits, every: 1, gates: {steps: 5, min_steps: 5, batch_size: 32, lam: 0.02}, "
    "min_class_samples: 10, ablation_samples: 40, ablations: [global]}, "
    "{name: misalignment, every: 1, head_samples: 20, probe: {epochs: 2}, head: {epochs: 2}}]",
]


@pytest.mark.parametrize(("model", "strategy", "gates"), [
    ("{name: torchvision, arch: resnet18}", "fedavg", 20),
    ("{name: user_mlp, hidden: [32, 16]}", "fedavg", 2),
    ("{name: user_mlp, hidden: [32, 16]}", "matched_avg", 2),  # a chain: its channel groups are read off
    ("{name: user_mlp, hidden: [32, 16]}", "circuit_masked_avg", 2),
])
def test_a_wrapped_model_runs_with_circuits_and_misalignment(model, strategy, gates, tmp_path):
    plugins.load()
    overrides = [f"model={model}", f"strategy={{name: {strategy}}}", *TINY]
    cfg = load_experiment(REPO / "experiments" / "circuits_smoke.yaml", overrides)
    run = run_in_process(cfg, tmp_path)
    assert read_status(run)["status"] == "completed"
    records = {r["name"]: r for r in read_records(run, "diagnostic")}
    assert sorted(records) == ["circuits", "misalignment"] and {r["round"] for r in records.values()} == {1}
    assert len(records["circuits"]["sizes"]["global"]) == gates  # a circuit over every gated layer
    assert 0.0 <= records["misalignment"]["probe"]["accuracy"] <= 1.0
    if strategy != "fedavg":  # its per-layer figures name the MLP's gated layers
        (record,) = read_records(run, "strategy")
        assert {key.rpartition("/")[2] for key in record if "/" in key} == {"1", "4"}, record
    for client in read_records(run, "client"):  # pruned to the target (0.5) by the end of local training
        assert client["sparsity"] == pytest.approx(0.5, abs=0.01)
