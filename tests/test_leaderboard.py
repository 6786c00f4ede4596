"""The leaderboard's methods (experiments/paper/leaderboard.yaml): each is listed with its
paper, and each runs end to end with the misalignment and circuits diagnostics, recording
the metrics its strategy declares."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import REPO, smoke_config
from fedmech_flwr import plugins
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.config import read_yaml
from fedmech_flwr.run_folder import read_records
from fedmech_flwr.strategy import STRATEGIES
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.sweep import load_sweep

LEADERBOARD = REPO / "experiments" / "paper" / "leaderboard.yaml"
METHODS: dict[str, dict] = read_yaml(LEADERBOARD)["zip"][0]
"""Method label -> its strategy, client and local SGD (learning rate and momentum)."""
PLAIN_SGD = {"fedavg-sgd", "scaffold", "feddyn"}
"""The plain-SGD block: the methods whose papers take plain SGD steps, and their FedAvg control."""

PAPER = re.compile(r"(arXiv:\d{4}\.\d{4,5}|(19|20)\d\d, [A-Z][A-Za-z]+)")
"""A citation in a summary: an arXiv id, or a year and a venue (``2021, KDD``)."""


def test_every_method_is_listed_with_its_paper(capsys):
    assert main(["list", "strategies"]) == 0
    listing = capsys.readouterr().out
    plugins.load()
    for method in METHODS.values():
        name = method["strategy"]["name"]
        assert f"\n  {name}  " in listing
        assert PAPER.search(STRATEGIES.get(name).summary), f"{name}: {STRATEGIES.get(name).summary!r}"


def test_the_cpu_grid_is_every_method_at_two_skews_and_three_seeds_in_two_sgd_blocks():
    plan = load_sweep(LEADERBOARD, preset="cpu")
    assert len(plan.cells) == len(METHODS) * 2 * 3 == 84
    assert {c.config.train.optimizer for c in plan.cells} == {"sgd"}
    sgd = {(c.axes["strategy+client+train.lr+train.momentum"], c.config.train.lr, c.config.train.momentum)
           for c in plan.cells}
    assert sgd == {(label, 0.02, 0.0) if label in PLAIN_SGD else (label, 0.05, 0.9) for label in METHODS}


def test_the_gpu_preset_gives_every_method_the_papers_learning_rate(monkeypatch):
    """Its own zipped group replaces the cpu one in place: lr 0.01, the plain-SGD block
    without momentum (validated as on a machine with CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = load_sweep(LEADERBOARD, preset="gpu")
    assert [a.name for a in plan.axes] == ["data.partition", "strategy+client+train.lr+train.momentum"]
    assert {(c.axes["strategy+client+train.lr+train.momentum"], c.config.train.lr, c.config.train.momentum)
            for c in plan.cells} == {(label, 0.01, 0.0 if label in PLAIN_SGD else 0.9) for label in METHODS}
    assert {c.config.data.dataset.name for c in plan.cells} == {"cifar10"}


SMOKE = [
    "data.audit_per_class=15", "pruning.mode=dense", "train.optimizer=sgd", "train.lr=0.05",
    "diagnostics=[{name: misalignment, every: 2, head_samples: 20, client_stats: []}, "
    "{name: circuits, every: 2, gates: {steps: 10, batch_size: 16}, min_class_samples: 5, ablation_samples: 20, "
    "ablations: [global]}]",
]


@pytest.mark.parametrize("label", [label for label in METHODS if label != "fedavg-sgd"])  # fedavg's own run
def test_each_method_runs_with_the_diagnostics_and_records_its_metrics(label, tmp_path):
    method = METHODS[label]
    cfg = smoke_config([*SMOKE, f"strategy={{name: {method['strategy']['name']}}}",
                        f"client={{name: {method['client']['name']}}}", f"train.momentum={method['train.momentum']}"])
    run = run_in_process(cfg, tmp_path)
    diagnostics = {r["name"] for r in read_records(run, "diagnostic") if r["round"] == 2}
    assert diagnostics == {"misalignment", "circuits"}
    outputs = STRATEGIES.get(cfg.strategy.name).outputs
    for record in read_records(run, "strategy") if outputs else []:
        for key, metric in outputs.metrics.items():
            assert math.isfinite(record[metric.path[0]]), f"round {record['round']}: {key} not recorded"
