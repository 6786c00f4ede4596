"""The leaderboard's methods (experiments/paper/leaderboard.yaml, the momentum block, and
leaderboard_plain_sgd.yaml): each is listed with its paper, and each runs end to end with
the misalignment and circuits diagnostics, recording the metrics its strategy declares."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import REPO, needs_dataset, smoke_config
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.strategy import STRATEGIES
from fedmech_flwr.spec.config import read_yaml
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.sweep import load_sweep

LEADERBOARD = REPO / "experiments" / "paper" / "leaderboard.yaml"
PLAIN_SGD = REPO / "experiments" / "paper" / "leaderboard_plain_sgd.yaml"
METHODS: dict[str, dict] = read_yaml(LEADERBOARD)["zip"][0]
"""The momentum block: method label -> its strategy and client."""
PLAIN_SGD_METHODS: dict[str, dict] = read_yaml(PLAIN_SGD)["zip"][0]
"""The plain-SGD block: the methods whose papers take plain SGD steps, and their FedAvg control."""
AXIS = "strategy+client"

PAPER = re.compile(r"(arXiv:\d{4}\.\d{4,5}|(19|20)\d\d, [A-Z][A-Za-z]+)")
"""A citation in a summary: an arXiv id, or a year and a venue (``2021, KDD``)."""


def test_every_method_is_listed_with_its_paper(capsys):
    assert main(["list", "strategies"]) == 0
    listing = capsys.readouterr().out
    plugins.load()
    for method in [*METHODS.values(), *PLAIN_SGD_METHODS.values()]:
        name = method["strategy"]["name"]
        assert f"\n  {name}  " in listing
        assert PAPER.search(STRATEGIES.get(name).summary), f"{name}: {STRATEGIES.get(name).summary!r}"


@pytest.mark.parametrize(("file", "methods", "lr", "momentum", "rounds"), [
    (LEADERBOARD, METHODS, 0.05, 0.9, [3, 10, 20]),
    (PLAIN_SGD, PLAIN_SGD_METHODS, 0.02, 0.0, [3, 10, 20, 40]),
], ids=["momentum", "plain-sgd"])
def test_each_cpu_block_is_its_methods_at_two_skews_and_three_seeds_with_one_sgd(file, methods, lr, momentum, rounds):
    """Each block trains every method with the same SGD as its FedAvg control, and runs
    the diagnostics from round 3 to its last (the plain-SGD block's head catches up later)."""
    plan = load_sweep(file, preset="cpu")
    assert len(plan.cells) == len(methods) * 2 * 3
    assert {c.axes[AXIS] for c in plan.cells} == set(methods)
    assert {(c.config.train.optimizer, c.config.train.lr, c.config.train.momentum) for c in plan.cells} == {
        ("sgd", lr, momentum)}
    assert {c.config.federation.num_rounds for c in plan.cells} == {rounds[-1]}
    assert {tuple(d.rounds) for c in plan.cells for d in c.config.diagnostics} == {tuple(rounds)}


@needs_dataset("cifar10")
@pytest.mark.parametrize(("file", "momentum"), [(LEADERBOARD, 0.9), (PLAIN_SGD, 0.0)], ids=["momentum", "plain-sgd"])
def test_the_gpu_preset_gives_every_method_the_papers_learning_rate(file, momentum, monkeypatch):
    """lr 0.01 on CIFAR-10, each block with its own momentum (validated as on a machine
    with CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = load_sweep(file, preset="gpu")
    assert [a.name for a in plan.axes] == ["data.partition", AXIS]
    assert {(c.config.train.lr, c.config.train.momentum) for c in plan.cells} == {(0.01, momentum)}
    assert {c.config.data.dataset.name for c in plan.cells} == {"cifar10"}


SMOKE = [
    "data.audit_per_class=15", "pruning.mode=dense", "train.optimizer=sgd", "train.lr=0.05",
    "diagnostics=[{name: misalignment, every: 2, head_samples: 20, client_stats: []}, "
    "{name: circuits, every: 2, gates: {steps: 10, batch_size: 16}, min_class_samples: 5, ablation_samples: 20, "
    "ablations: [global]}]",
]


BLOCKS = [(label, method, 0.9) for label, method in METHODS.items()] + [
    (label, method, 0.0) for label, method in PLAIN_SGD_METHODS.items() if label != "fedavg-sgd"]  # fedavg's own run


@pytest.mark.parametrize(("label", "method", "momentum"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_each_method_runs_with_the_diagnostics_and_records_its_metrics(label, method, momentum, tmp_path):
    cfg = smoke_config([*SMOKE, f"strategy={{name: {method['strategy']['name']}}}",
                        f"client={{name: {method['client']['name']}}}", f"train.momentum={momentum}"])
    run = run_in_process(cfg, tmp_path)
    diagnostics = {r["name"] for r in read_records(run, "diagnostic") if r["round"] == 2}
    assert diagnostics == {"misalignment", "circuits"}
    outputs = STRATEGIES.get(cfg.strategy.name).outputs
    for record in read_records(run, "strategy") if outputs else []:
        for key, metric in outputs.metrics.items():
            assert math.isfinite(record[metric.path[0]]), f"round {record['round']}: {key} not recorded"
