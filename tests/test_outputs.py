"""What a plug-in records, a user sees: metrics a diagnostic or a strategy records without
declaring them reach ``fedmech status``, the report, ``fedmech export`` and TensorBoard
under a generic heading, a one-line notice at the first round says how to declare them,
a strategy's parameters name its leaderboard row, and a declaration names a key once (the
records' key rule applies itself)."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_report import CLASSES, config, write_run

from fedmech_flwr.artifacts.folder import RunFolder, read_records
from fedmech_flwr.contracts.outputs import Metric, Outputs, declared, undeclared
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.report import write_report
from fedmech_flwr.tools.status import run_status

LAB = '''
from dataclasses import dataclass

from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic
from fedmech_flwr.api.strategy import STRATEGIES


@DIAGNOSTICS.register("{name}_spread")  # as `fedmech new diagnostic` writes it: no outputs=
class Spread(Diagnostic):
    pass


@dataclass
class KrumConfig:
    f: int = 1
    """Byzantine clients tolerated."""


@STRATEGIES.register("{name}_krum", KrumConfig)  # no outputs= either
def krum(params, ctx):
    raise NotImplementedError
'''


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> str:
    """A user's package with a diagnostic and a strategy that declare nothing, imported as
    a run's ``plugins:`` would import it; its name (registries are per process)."""
    folder = tmp_path_factory.mktemp("lab")
    name = "bare" + str(abs(hash(str(folder))) % 10**6)
    (folder / f"{name}.py").write_text(LAB.format(name=name))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        from fedmech_flwr.contracts import plugins

        plugins.import_plugin(name, "lab.yaml: plugins[0]")
    return name


def lab_run(path: Path, name: str, seed: int = 0, **strategy) -> Path:
    """A completed run of the lab's strategy and diagnostic: what they record undeclared
    (spread, points; krum_selected) beside what the core records (seconds; the clients'
    train_accuracy averaged and aggregate_seconds in the strategy record)."""
    cfg = {**config(seed), "plugins": [name], "strategy": {"name": f"{name}_krum", **strategy}}
    run = write_run(path, cfg)
    with open(run / "metrics.jsonl", "a") as fh:
        for r in (1, 2):
            for record in ({"kind": "diagnostic", "round": r, "name": f"{name}_spread", "seconds": 0.1,
                            "spread": 0.25 * r + 0.1 * seed, "points": 3, "detail": {"nested": 1.0}, "ok": True},
                           {"kind": "strategy", "round": r, "krum_selected": 2, "aggregate_seconds": 0.01,
                            "train_accuracy": 0.5}):
                fh.write(json.dumps(record) + "\n")
    return run


def test_undeclared_metrics_are_declared_from_the_records_shape(lab, tmp_path):
    records = read_records(lab_run(tmp_path / "run", lab))
    generic = undeclared(records)
    assert {k: list(o.metrics) for k, o in generic.items()} == {f"{lab}_spread": ["spread", "points", "detail.nested"],
                                                                "strategy": ["krum_selected"]}
    assert generic[f"{lab}_spread"].metrics["detail.nested"].path == ("detail", "nested")  # a dictionary, per key
    assert generic["strategy"].title == "strategy: metrics it records without declaring them (as recorded)"
    metrics = declared(records)
    spread = metrics[f"{lab}_spread.spread"]
    assert (spread.label, spread.unit, spread.record, spread.heading) == ("spread", "", f"{lab}_spread", "spread")
    assert "strategy.krum_selected" in metrics and "strategy.train_accuracy" not in metrics
    assert "strategy.aggregate_seconds" not in metrics and f"{lab}_spread.seconds" not in metrics
    assert f"{lab}_spread.spread" not in declared()  # only where records hold it
    # a run of the built-ins declares everything it records: nothing generic
    assert undeclared(read_records(write_run(tmp_path / "builtin", config(0)))) == {}


def test_status_shows_them(lab, tmp_path):
    text = run_status(lab_run(tmp_path / "run", lab))
    assert f"  undeclared (as recorded): {lab}_spread.spread 0.500 | {lab}_spread.points 3.000 | " \
           f"{lab}_spread.detail.nested 1.000 | strategy.krum_selected 2.000" in text.splitlines()


def test_the_report_and_export_show_them_under_a_generic_heading(lab, tmp_path):
    runs = [lab_run(tmp_path / f"run{seed}", lab, seed) for seed in (0, 1)]
    write_report(runs, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"## {lab}_spread: metrics it records without declaring them (as recorded)" in md
    assert "## strategy: metrics it records without declaring them (as recorded)" in md
    assert "| group | runs | spread | points |" in md and "| group | runs | krum_selected |" in md
    stats = json.loads((tmp_path / "out" / "summary.json").read_text())["groups"][0]["stats"]
    assert stats[f"{lab}_spread.spread"]["mean"] == pytest.approx(0.55)
    assert stats["strategy.krum_selected"]["mean"] == pytest.approx(2.0)

    out = tmp_path / "runs.csv"
    assert main(["export", *map(str, runs), "--out", str(out)]) == 0
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    spread = [r for r in rows if r["run"] == "run1" and r["metric"] == f"{lab}_spread.spread"]
    assert [(r["round"], r["record"], r["label"], r["unit"], r["value"]) for r in spread] == [
        ("1", f"{lab}_spread", "spread", "", "0.35"), ("2", f"{lab}_spread", "spread", "", "0.6")]
    assert {r["value"] for r in rows if r["metric"] == "strategy.krum_selected"} == {"2.0"}
    nested = [r for r in rows if r["run"] == "run1" and r["metric"] == f"{lab}_spread.detail.nested"]
    assert [(r["round"], r["label"], r["value"]) for r in nested] == [("1", "detail.nested", "1.0"),
                                                                      ("2", "detail.nested", "1.0")]


def test_tensorboard_shows_them(lab, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedmech_flwr.app.tensorboard_events import TENSORBOARD_DIR, EventFiles

    records = read_records(lab_run(tmp_path / "run", lab))
    events = EventFiles(tmp_path, "name: t", CLASSES)
    for r in (1, 2):
        events.round(r, [record for record in records if record["round"] == r])
    events.close([])
    read = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    read.Reload()
    assert [(e.step, e.value) for e in read.Scalars(f"{lab}_spread/spread")] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in read.Scalars("strategy/krum_selected")] == [2.0, 2.0]
    assert [e.value for e in read.Scalars(f"{lab}_spread/detail.nested")] == [1.0, 1.0]  # one scalar per key
    assert "eval/accuracy" in read.Tags()["scalars"]


def test_a_notice_at_the_first_round_says_how_to_declare_them(lab, tmp_path, caplog):
    from fedmech_flwr.app.run import Run

    records = read_records(lab_run(tmp_path / "run", lab))
    run = SimpleNamespace(_noticed=set(), cfg=SimpleNamespace(strategy=SimpleNamespace(name=f"{lab}_krum")))
    with caplog.at_level(logging.INFO, logger="fedmech_flwr.app.run"):
        for r in (1, 2):
            Run._notice_undeclared(run, [record for record in records if record["round"] == r])
    lines = [rec for rec in caplog.records if "does not declare" in rec.getMessage()]
    assert [rec.levelno for rec in lines] == [logging.WARNING, logging.WARNING]  # once each, at round 1
    assert lines[0].getMessage() == (
        f"DIAGNOSTICS '{lab}_spread' records metrics it does not declare (spread, points, detail.nested): they are "
        f"shown as recorded under '{lab}_spread: metrics it records without declaring them (as recorded)'; to give them "
        f"labels, units and curves, register it with DIAGNOSTICS.register('{lab}_spread', ..., "
        "outputs=Outputs(...)) (fedmech_flwr.api)")
    assert lines[1].getMessage().startswith(f"STRATEGIES '{lab}_krum' records metrics it does not declare "
                                            "(krum_selected)")


def test_a_strategys_parameters_name_its_leaderboard_row(lab, tmp_path):
    """Those that differ from their defaults or between its rows; none: its name alone."""
    runs = [lab_run(tmp_path / "krum2", lab, f=2), lab_run(tmp_path / "krum1", lab, 0, f=1),
            write_run(tmp_path / "fedavg", {**config(0), "plugins": [lab]})]
    write_report(runs, tmp_path / "out")
    board = (tmp_path / "out" / "report.md").read_text().split("## Strategy leaderboard")[1].split("##")[0]
    labels = sorted(line.split(" | ")[0] for line in board.splitlines() if line.startswith((f"| {lab}", "| fedavg")))
    assert labels == [f"| {lab}_krum(f=1) + plain", f"| {lab}_krum(f=2) + plain", "| fedavg(examples) + plain"]
    write_report(runs[1:], tmp_path / "default")  # one krum, at its default: nothing to name
    board = (tmp_path / "default" / "report.md").read_text().split("## Strategy leaderboard")[1]
    assert f"| {lab}_krum + plain |" in board


def test_a_key_is_declared_once_as_sent():
    """``Outputs`` applies the records' key rule: Flower's ``my-key`` is recorded ``my_key``."""
    outputs = Outputs("t", {"my-key": Metric("m", ("my-key", "inner-key"), "%", per_class=("my-key-per-class",))},
                      curves=("my-key",), headline=("my-key",))
    metric = outputs.metrics["my_key"]
    assert list(outputs.metrics) == ["my_key"] and outputs.curves == outputs.headline == ("my_key",)
    assert (metric.path, metric.per_class) == (("my_key", "inner-key"), ("my_key_per_class",))
    metrics = declared()
    assert {"strategy.feddyn_h_norm", "strategy.sent_model_accuracy", "strategy.scaffold_control_norm",
            "strategy.fedopt_update_norm", "strategy.fedrod_personal_accuracy"} <= set(metrics)
    assert metrics["strategy.scaffold_control_norm"].path == ("scaffold_control_norm",)


def test_every_record_writes_its_keys_one_way(tmp_path):
    from fedmech_flwr.contracts.hooks import DiagnosticResult

    folder = RunFolder(tmp_path)
    folder.diagnostic(1, "d", DiagnosticResult({"my-key": 1.0, "nested": {"inner-key": 2.0}}), 0.5)
    folder.strategy(1, {"my-key": 3.0})
    assert read_records(tmp_path) == [
        {"kind": "diagnostic", "round": 1, "name": "d", "seconds": 0.5, "my_key": 1.0, "nested": {"inner-key": 2.0}},
        {"kind": "strategy", "round": 1, "my_key": 3.0}]


def test_keys_a_declaring_diagnostic_records_beside_its_declared_ones_are_named_once(caplog):
    """A diagnostic that declares some outputs and records a per-layer dictionary beside
    them: the dictionary is shown nowhere, so the run says so once, naming the key."""
    from types import SimpleNamespace

    from fedmech_flwr.app.run import Run
    from fedmech_flwr.contracts.outputs import unshown

    records = [{"kind": "diagnostic", "round": r, "name": "weight_divergence", "seconds": 0.1,
                "mean": {"relative_distance": 0.1}, "per_layer_extra": {"conv1": 0.2}} for r in (1, 2)]
    assert unshown(records) == {"weight_divergence": ["per_layer_extra"]}  # its declared "mean" and "seconds" not
    run = SimpleNamespace(_noticed=set(), cfg=SimpleNamespace(strategy=SimpleNamespace(name="fedavg")))
    with caplog.at_level(logging.INFO, logger="fedmech_flwr.app.run"):
        for record in records:
            Run._notice_undeclared(run, [record])
    said = [rec.getMessage() for rec in caplog.records if "without declaring them" in rec.getMessage()]
    assert len(said) == 1 and "per_layer_extra" in said[0] and "fedmech_flwr.api" in said[0]
