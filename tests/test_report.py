"""``fedmech report`` over hand-built run folders and a sweep manifest: groups, known
means and intervals, partial / failed / pending runs, undefined IoUs, published values,
summary.json, and the page in a real headless browser."""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import CHROMIUM, REPO, browser_page
from fedmech_flwr.artifacts.folder import RunFolder, read_records
from fedmech_flwr.contracts.outputs import declarations, declared, recorded_flags
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.safe_text import CONTROL
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.report import Stat, format_stat, read_inputs, read_paper_values, write_report

T2 = 4.302652730  # t_{0.975, df=2}
T1 = 12.706204736  # t_{0.975, df=1}
PAPER = Path(__file__).parent / "data" / "paper_values.yaml"
PAPER_VALUES = Path(__file__).parents[1] / "experiments" / "paper" / "values.yaml"
CLASSES = ["zero", "one", "two", "three"]

BASE = {
    "name": "misalign", "seed": 0, "output_root": "~/fedmech-runs", "device": "cpu",
    "data": {"dataset": {"name": "cifar10"}, "partition": {"name": "dirichlet", "alpha": 0.05, "min_samples": 10}},
    "model": {"name": "simple_cnn", "channels": [4, 8]},
    "client": {"name": "plain"}, "strategy": {"name": "fedavg", "weighting": "examples"},
    "federation": {"num_clients": 3, "num_rounds": 2},
    "diagnostics": [{"name": "misalignment", "every": 1}, {"name": "circuits", "every": 1}],
}


def config(seed: int, **changes) -> dict:
    """BASE with dotted ``changes`` (``data__partition={...}`` sets data.partition)."""
    cfg = copy.deepcopy(BASE)
    cfg["seed"] = seed
    for dotted, value in changes.items():
        node, keys = cfg, dotted.split("__")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return cfg


def write_run(path: Path, cfg: dict, status: str = "completed", accuracy: float = 0.5, probe_gap: float = 0.2,
              intra: float | None = 0.6, per_class: list | None = None, error: str | None = None,
              started: str = "2025-01-01T10:00:00+00:00", updated: str = "2025-01-01T10:01:30+00:00",
              usae: bool = False, collapsed: bool = False, empty_circuits: bool = False) -> Path:
    """A run folder with the real file and record layout; the final round's values given,
    earlier rounds a little lower. ``collapsed``: the global model predicts one class for
    every test image; ``empty_circuits``: every local circuit is empty, so each
    local-to-global IoU is 0 against the global model's non-empty circuit."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    status_doc = {"status": status, "updated_at": updated, "pid": 1, "host": "h"}
    if error:
        status_doc["error"] = error
    (path / "status.json").write_text(json.dumps(status_doc))
    (path / "environment.json").write_text(json.dumps({
        "started_at": started, "seed": cfg["seed"], "device": "cpu", "git": {"commit": "0123456789abcdef", "dirty": True},
    }))
    (path / "partitions.json").write_text(json.dumps({"num_clients": 3, "class_names": CLASSES, "audit_samples": 40,
                                                      "clients": [{"label_histogram": [5, 5, 5, 5]}] * 3}))
    per_class = per_class or [accuracy] * 4
    one = {"max_predicted_class": 0, "max_predicted_fraction": 1.0 if collapsed else 0.3}
    spread = {"max_predicted_class": 1, "max_predicted_fraction": 0.3}
    lines = []
    rounds = cfg["federation"]["num_rounds"]
    for r in range(rounds + 1):
        scale = 1.0 if r == rounds else 0.5 + 0.2 * r
        lines.append({"kind": "eval", "round": r, "loss": 1.0, "accuracy": accuracy * scale,
                      "per_class_accuracy": per_class if r == rounds else [0.1] * 4, **one, "sparsity": 0.9,
                      "layer_sparsity": {"conv1": 0.9}, "clients_sampled": [0, 1, 2], "clients_succeeded": [0, 1, 2],
                      "train_round_seconds": 1.5, "server_peak_rss_mb": 300.0})
        if r == 0:
            continue
        lines.append({"kind": "client", "round": r, "partition_id": 0, "num_examples": 10, "train_accuracy": 0.5,
                      "sparsity": 0.9})
        glob = accuracy * scale
        lines.append({
            "kind": "diagnostic", "round": r, "name": "misalignment", "seconds": 0.3,
            "global": {"accuracy": glob, "per_class": [glob] * 4, **one},
            "probe": {"accuracy": glob + probe_gap, "per_class": [glob] * 4, "validation_accuracy": 0.7, "epoch": 3,
                      **spread},
            "realigned": {"accuracy": glob + probe_gap / 2, "per_class": [glob] * 4, "epoch": 2, **spread},
            "realigned_test_selected": {"accuracy": glob + probe_gap / 2, "per_class": [glob] * 4, "epoch": 2,
                                        "note": "epoch selected on the test set"},
            "tau_norm": {"accuracy": glob, "per_class": [glob] * 4},
            "gaps": {"probe": probe_gap, "realigned": probe_gap / 2},
            "per_class_gaps": {"probe": [probe_gap] * 4, "realigned": [probe_gap / 2] * 4},
            "split": {"train": 24, "validation": 8, "head": 8},
        })
        mean = {"intra_client": intra if r > 1 else None, "inter_client": 0.4,
                "local_to_global": 0.0 if empty_circuits else 0.3, "inter_class_local": 0.2, "inter_class_global": 0.2}
        lines.append({
            "kind": "diagnostic", "round": r, "name": "circuits", "seconds": 0.5, "mean": mean,
            "pairs": {key: 3 for key in mean}, "undefined": {key: 0 for key in mean},
            "empty": {"intra_client": 2, "inter_client": 0, "local_to_global": 3 if empty_circuits else 1,
                      "inter_class_local": 0, "inter_class_global": 0},
            "per_class": {"0": {"clients": [0, 1], "intra_client": intra, "intra_client_empty": 2}},
            "sizes": {"local": {"conv1": 2.0}, "global": {"conv1": 3.0}}, "ablation": {}, "client_seconds": {},
            "moving_average": 1,
        })
        if usae:
            overlap = {"threshold": 0.0, "shared": 90, "unique": {"global": 5}, "dead": 2, "alive": 100, "overlap": 0.9}
            lines.append({"kind": "diagnostic", "round": r, "name": "usae", "seconds": 2.0, "layer": "conv2",
                          "overlap": {"fires_once": overlap, "thresholded": {**overlap, "threshold": 0.01, "overlap": 0.8}},
                          "r2_cross_mean": 0.55, "r2_self_mean": 0.9})
    if status != "completed":
        lines = lines[: len(lines) // 2]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line, allow_nan=True) + "\n" for line in lines))
    return path


PROX = {"strategy__name": "fedprox", "strategy__proximal_mu": 0.01, "client__name": "proximal"}
IID = {"data__partition": {"name": "iid"}}


def make_sweep(root: Path, resumed: bool = False) -> Path:
    """A sweep of three groups x seeds 0..2:

    - iid_fedavg: all completed; final accuracy 0.80 / 0.82 / 0.84, probe gap 0.10 / 0.12 / 0.14;
    - dir_fedavg: seed 0 completed as a one-class model (accuracy 0.25 of 4 classes, gap
      0.30), seed 1 running, seed 2 failed;
    - dir_fedprox: seeds 0, 1 completed with undefined intra-client IoUs; seed 2 pending (no folder).

    ``resumed``: the same results written at other times and wall times, and a manifest
    the interrupted sweep left stale.
    """
    runs = root / "runs"
    cells = []
    times = ("2025-03-01T08:00:00+00:00", "2025-03-01T09:40:00+00:00") if resumed else \
        ("2025-01-01T10:00:00+00:00", "2025-01-01T10:01:30+00:00")

    def cell(name, group, seed, axes, cfg, status, seconds=None, error=None):
        cells.append({"name": name, "group": group, "seed": seed, "axes": axes, "run_dir": f"runs/{name}",
                      "status": status, "error": error, "seconds": seconds, "config": cfg})

    for seed, (acc, gap) in enumerate([(0.80, 0.10), (0.82, 0.12), (0.84, 0.14)]):
        cfg = config(seed, **IID)
        per_class = [0.9, 0.8, None, 0.7] if seed == 0 else [0.9, 0.8, None, 0.5]
        write_run(runs / f"iid_fedavg_s{seed}", cfg, accuracy=acc, probe_gap=gap, per_class=per_class,
                  started=times[0], updated=times[1], usae=True)
        # an interrupted sweep's manifest may still say running for a run whose folder completed
        cell(f"iid_fedavg_s{seed}", "iid_fedavg", seed, {"data.partition": "iid", "strategy": "fedavg"}, cfg,
             "running" if resumed and seed == 2 else "completed", None if resumed else 71.0 + seed)
    axes = {"data.partition": "dir0.05", "strategy": "fedavg"}
    write_run(runs / "dir_fedavg_s0", config(0), accuracy=0.25, probe_gap=0.30, started=times[0], updated=times[1],
              collapsed=True)
    cell("dir_fedavg_s0", "dir_fedavg", 0, axes, config(0), "completed", 60.0)
    write_run(runs / "dir_fedavg_s1", config(1), status="running", accuracy=0.1)
    cell("dir_fedavg_s1", "dir_fedavg", 1, axes, config(1), "running")
    write_run(runs / "dir_fedavg_s2", config(2), status="failed", error="round 2: test loss is nan (diverged)")
    cell("dir_fedavg_s2", "dir_fedavg", 2, axes, config(2), "failed", 12.0, "exit 1")
    axes = {"data.partition": "dir0.05", "strategy": "fedprox"}
    for seed in (0, 1):
        write_run(runs / f"dir_fedprox_s{seed}", config(seed, **PROX), accuracy=0.45 + 0.1 * seed, probe_gap=0.2,
                  intra=None, started=times[0], updated=times[1])
        cell(f"dir_fedprox_s{seed}", "dir_fedprox", seed, axes, config(seed, **PROX), "completed", 50.0)
    cell("dir_fedprox_s2", "dir_fedprox", 2, axes, config(2, **PROX), "pending")
    (root / "sweep.json").write_text(json.dumps({
        "file": str(root / "sweep.yaml"), "name": "misalign-v2", "preset": "cpu", "seeds": [0, 1, 2],
        "axes": ["data.partition", "strategy"], "cells": cells}, indent=1))
    # the sweep is alive (this process holds its lock), so its running cell is running
    (root / "sweep.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return root


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory) -> tuple[Path, dict]:
    root = make_sweep(tmp_path_factory.mktemp("sweep"))
    out = tmp_path_factory.mktemp("report")
    index = write_report([root], out, paper_file=PAPER)
    assert index == out / "index.html"
    return out, json.loads((out / "summary.json").read_text())


def group(summary: dict, label: str) -> dict:
    return next(g for g in summary["groups"] if g["group"] == label)


def test_groups_hold_the_hand_computed_means_and_intervals(sweep_report):
    _, summary = sweep_report
    assert [g["group"] for g in summary["groups"]] == ["iid_fedavg", "dir_fedavg", "dir_fedprox"]
    iid = group(summary, "iid_fedavg")
    assert (iid["runs"], iid["completed"], iid["partial"]) == (3, 3, False)
    acc = iid["stats"]["eval.accuracy"]
    assert acc["mean"] == pytest.approx(82.0) and acc["n"] == 3 and acc["rounds"] == [2]
    assert acc["half_width"] == pytest.approx(T2 * 2 / math.sqrt(3))
    gap = iid["stats"]["misalignment.gaps.probe"]
    assert gap["mean"] == pytest.approx(12.0) and gap["half_width"] == pytest.approx(T2 * 2 / math.sqrt(3))
    assert iid["stats"]["misalignment.probe"]["mean"] == pytest.approx(94.0)
    assert iid["stats"]["eval.sparsity"]["mean"] == pytest.approx(90.0)
    assert iid["stats"]["usae.overlap"]["mean"] == pytest.approx(90.0)
    assert iid["stats"]["usae.r2_cross_mean"]["mean"] == pytest.approx(0.55)
    assert "misalignment.ncm" not in iid["stats"]  # not measured: absent, not undefined
    prox = group(summary, "dir_fedprox")["stats"]["eval.accuracy"]
    assert prox["mean"] == pytest.approx(50.0) and prox["half_width"] == pytest.approx(T1 * 0.05 * 100)
    assert prox["flags"] == {} and acc["flags"] == {}


def test_partial_failed_and_pending_runs_are_listed_never_averaged(sweep_report):
    out, summary = sweep_report
    fedavg = group(summary, "dir_fedavg")
    assert (fedavg["completed"], fedavg["partial"]) == (1, True)
    assert [c["status"] for c in fedavg["cells"]] == ["completed", "running", "failed"]
    acc = fedavg["stats"]["eval.accuracy"]
    assert (acc["mean"], acc["half_width"], acc["n"], acc["flags"]) == (pytest.approx(25.0), None, 1, {"one class": 1})
    assert [c["status"] for c in group(summary, "dir_fedprox")["cells"]] == ["completed", "completed", "pending"]
    md = (out / "report.md").read_text()
    assert "| dir_fedavg | 1 of 3 completed (partial) | 25.0 (n=1, no interval) ⚑ one class in 1/1 seeds |" in md
    assert "dir_fedavg_s2 (group dir_fedavg, seed 2): failed: round 2: test loss is nan (diverged)" in md
    assert "dir_fedprox_s2 (group dir_fedprox, seed 2): pending" in md
    assert "dir_fedavg_s1 (group dir_fedavg, seed 1): running" in md
    assert "+30.0 pp (n=1, no interval) ⚑ one class in 1/1 seeds" in md  # a gap against a one-class model


def test_running_cells_of_a_dead_sweep_read_interrupted(tmp_path):
    sweep = make_sweep(tmp_path / "sweep")
    (sweep / "sweep.lock").unlink()  # the sweep was SIGKILLed: no live lock holder
    (sweep / "runs" / "dir_fedavg_s1" / "status.json").unlink()  # killed before the run wrote its status
    write_report([sweep], tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [c["status"] for c in group(summary, "dir_fedavg")["cells"]] == ["completed", "interrupted", "failed"]
    assert "dir_fedavg_s1 (group dir_fedavg, seed 1): interrupted: its sweep was killed; run the same `fedmech " \
           "sweep` command again to continue it" in (tmp_path / "out" / "report.md").read_text().replace("\\", "")


def test_a_run_whose_writer_died_reads_interrupted_with_the_resume_command(tmp_path):
    """status.json says running, but its pid is gone from this host (a power cut of the
    ServerApp, a full disk): the report says interrupted and how to continue it."""
    sweep = make_sweep(tmp_path / "sweep")
    run = sweep / "runs" / "dir_fedavg_s1"
    dead = subprocess.Popen(["true"])
    dead.wait()
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "pid": dead.pid, "host": socket.gethostname()}))
    _, runs = read_inputs([run])
    assert runs[0].status == "interrupted"
    assert runs[0].error == f"its process ended without recording an outcome; continue it with `fedmech run --resume {run}`"


def test_undefined_ious_are_counted_and_shown_as_undefined(sweep_report):
    out, summary = sweep_report
    intra = group(summary, "dir_fedprox")["stats"]["circuits.intra_client"]
    assert (intra["mean"], intra["n"], intra["undefined"], intra["empty"]) == (None, 0, 2, 4)
    defined = group(summary, "iid_fedavg")["stats"]["circuits.intra_client"]
    assert (defined["mean"], defined["n"], defined["empty"]) == (pytest.approx(0.6), 3, 6)
    row = next(line for line in (out / "report.md").read_text().splitlines()
               if line.startswith("| dir_fedprox |") and "IoU" not in line and "undefined" in line)
    assert "undefined (4 empty)" in row
    assert "0.30 ± 0.00 (n=2), 2 empty" in row


def test_published_values_are_held_against_intervals_and_flags(sweep_report):
    """Points only at the paper's protocol; elsewhere the direction or bound must hold for
    the whole interval; a flagged value satisfies nothing."""
    out, summary = sweep_report
    paper = {(p["metric"], p["value"], p["group"]): p for p in summary["paper"]}
    probe = paper["misalignment.probe", 64.7, "dir_fedavg"]  # 0.25 + 0.30 = 55.0% vs 64.7%, same protocol
    assert probe["same_protocol"] and probe["difference"] == pytest.approx(55.0 - 64.7)
    assert probe["result"] == "not shown: global: one class in 1/1 seeds" and probe["holds"] is None
    assert ("misalignment.probe", 64.7, "dir_fedprox") not in paper  # where names strategy fedavg
    gap = paper["misalignment.gaps.probe", 10.0, "iid_fedavg"]  # 12 ± 4.97 > 0, at an unstated protocol
    assert (gap["holds"], gap["same_protocol"], gap["difference"]) == (True, False, None)
    assert gap["tested"]["half_width"] == pytest.approx(T2 * 2 / math.sqrt(3))
    control = paper["eval.accuracy", 82.0, "iid_fedavg"]  # against the one-class alpha 0.05 control
    assert control["tested"]["mean"] == pytest.approx(82.0 - 25.0)
    assert control["result"] == "not shown: control dir_fedavg: one class in 1/1 seeds"
    assert paper["circuits.local_to_global", 0.5, "iid_fedavg"]["holds"] is True  # 0.30 ± 0 < 0.5
    assert paper["circuits.local_to_global", 0.5, "dir_fedavg"]["result"] == "not shown: one run, no interval"
    assert paper["eval.accuracy", 90.0, "iid_fedavg"]["holds"] is False  # 82 ± 4.97 lies below 90
    contains = paper["eval.accuracy", 80.0, "iid_fedavg"]
    assert (contains["holds"], contains["result"]) == (None, "not shown: the interval contains it")
    flagged = paper["eval.accuracy", 20.0, "dir_fedavg"]  # 25.0 > 20, but a one-class model's
    assert (flagged["holds"], flagged["result"]) == (None, "not shown: one class in 1/1 seeds")
    assert paper["eval.accuracy", 75.0, None]["group"] is None  # resnet10: no group
    assert paper["misalignment.ncm", 60.0, None]["group"] is None  # iid groups match but did not measure NCM
    md = (out / "report.md").read_text()
    assert ("| probe (%) | dir_fedavg | = 64.7 \\[1\\] | 55.0 (n=1, no interval) | &gt; global of the same runs | "
            "not shown: global: one class in 1/1 seeds (+30.0 pp) | -9.7 pp |") in md
    assert "| ours − paper (same protocol only) |" in md
    assert "Not measured by any group here: global test accuracy ≈ 75.0 \\[8\\]; NCM = 60.0 \\[9\\]." in md
    assert ("\\[1\\] arXiv 2512.23043 v2, a machine-generated public summary of the later version (not the "
            "authors' text): “linear probe accuracy remains high and stable (dropping only to 64.7%)”. Inferred: "
            "CIFAR-10 and alpha 0.05.") in md
    assert "| paper v2 | 3 | 2 |" in md and "| paper test | – | not stated |" in md  # the protocols compared


def test_the_leaderboard_ranks_strategies_by_mean_accuracy(sweep_report):
    out, _ = sweep_report
    md = (out / "report.md").read_text()
    board = md.split("## Strategy leaderboard")[1].split("##")[0]
    rows = [line for line in board.splitlines() if line.startswith("| fed")]
    # fedavg: mean of 82.0 (iid) and 25.0 (dirichlet) = 53.5, flagged: a one-class model is behind it;
    # fedprox: 50.0 (dirichlet only)
    assert rows[0].startswith("| fedavg(examples) + plain |") and rows[0].endswith("| 53.5 ⚑ |")
    assert rows[1].startswith("| fedprox(examples) + proximal | – |")  # one fedprox: mu tells nothing apart
    assert "| strategy + client | iid | dirichlet(alpha=0.05) | mean over columns (%) |" in board


def test_a_leaderboard_row_names_the_parameters_that_tell_its_strategy_apart(tmp_path):
    runs = [write_run(tmp_path / f"prox{mu}", config(0, **{**PROX, "strategy__proximal_mu": mu})) for mu in (0.01, 0.1)]
    runs.append(write_run(tmp_path / "fedavg", config(0)))
    write_report(runs, tmp_path / "out")
    board = (tmp_path / "out" / "report.md").read_text().split("## Strategy leaderboard")[1].split("##")[0]
    labels = sorted(line.split(" | ")[0] for line in board.splitlines() if line.startswith("| fed"))
    assert labels == ["| fedavg(examples) + plain", "| fedprox(examples, proximal_mu=0.01) + proximal",
                      "| fedprox(examples, proximal_mu=0.1) + proximal"]


@pytest.mark.parametrize(("trim", "recorded", "label"), [
    (1, {"trim": 1}, "| labtrim + plain"),  # the default it recorded: nothing to name
    (2, {"trim": 1}, "| labtrim(trim=2) + plain"),
    (1, None, "| labtrim(trim=1) + plain"),  # a folder that recorded no defaults: every parameter
])
def test_a_plugin_strategys_row_names_what_differs_from_the_defaults_its_runs_recorded(tmp_path, trim, recorded, label):
    """The page never imports the plug-in: the defaults come from the run folder."""
    run = write_run(tmp_path / "own", {**config(0), "strategy": {"name": "labtrim", "trim": trim}})
    if recorded is not None:
        RunFolder(run).write_outputs(declarations(), {}, recorded)
    write_report([run, write_run(tmp_path / "fedavg", config(0))], tmp_path / "out")
    board = (tmp_path / "out" / "report.md").read_text().split("## Strategy leaderboard")[1].split("##")[0]
    assert label in [line.split(" | ")[0] for line in board.splitlines()]


def test_the_outputs_are_complete_and_the_markdown_links_its_plots(sweep_report):
    out, _ = sweep_report
    names = sorted(p.name for p in (out / "plots").iterdir())
    # two rounds of diagnostics: too few for curves of the gap and the IoUs (the tables show them);
    # per class: the global model's recall and the misalignment diagnostic's headline metrics
    assert names == ["eval_accuracy.png", "headline.png", "per_class_misalignment_gaps_probe.png",
                     "per_class_misalignment_probe.png", "per_class_recall.png"]
    md = (out / "report.md").read_text()
    assert all(f"](plots/{name})" in md for name in names)
    page = (out / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(names)
    assert "<script" not in page
    assert all(url.startswith("data:") for url in re.findall(r'(?:src|href)="([^"]*)"', page))  # nothing to fetch


def test_a_resumed_sweep_gives_the_same_summary(tmp_path, sweep_report):
    _, summary = sweep_report
    resumed = make_sweep(tmp_path / "elsewhere", resumed=True)
    write_report([resumed], tmp_path / "out", paper_file=PAPER)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    text = (tmp_path / "out" / "summary.json").read_text()
    assert str(tmp_path) not in text and "seconds" not in text and "2025-" not in text


def test_every_metric_shows_at_the_rounds_asked_for_beside_the_final(tmp_path, caplog):
    """--rounds: each group's row at round 1 holds the runs' round-1 values, so a reader sees
    which effects are transient; an undefined value stays undefined there, and a round no
    run reached is said to be so, never filled from another round."""
    runs = [write_run(tmp_path / f"s{seed}", config(seed, federation={"num_clients": 3, "num_rounds": 3}),
                      accuracy=acc, probe_gap=gap) for seed, acc, gap in ((0, 0.80, 0.10), (1, 0.84, 0.14))]
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "out"), "--rounds", "9,1"]) == 0
    assert "round 9: no run reached it (the latest round recorded is 3)" in caplog.text
    stats = json.loads((tmp_path / "out" / "summary.json").read_text())["groups"][0]
    first, final = stats["at_rounds"]["1"], stats["stats"]
    assert first["eval.accuracy"]["mean"] == pytest.approx(82.0 * 0.7) and first["eval.accuracy"]["rounds"] == [1]
    assert first["eval.accuracy"]["half_width"] == pytest.approx(T1 * 0.02 * 0.7 * 100)
    assert first["misalignment.gaps.probe"]["mean"] == pytest.approx(12.0)
    assert final["eval.accuracy"]["mean"] == pytest.approx(82.0) and final["eval.accuracy"]["rounds"] == [3]
    assert (first["circuits.intra_client"]["mean"], first["circuits.intra_client"]["undefined"]) == (None, 2)
    assert final["circuits.intra_client"]["mean"] == pytest.approx(0.6)
    assert stats["at_rounds"]["9"] == {}
    table = (tmp_path / "out" / "report.md").read_text().split("| group | runs | round |")[1]
    rows = [line.split(" | ")[2:4] for line in table.splitlines()[2:5]]
    assert rows == [["1", "57.4 ± 17.8 (n=2)"], ["9", "–"], ["final", "82.0 ± 25.4 (n=2)"]]


def test_a_round_before_the_first_is_refused_by_name(tmp_path, capsys):
    run = write_run(tmp_path / "run", config(0))
    for bad in ("0", "3,ten", "3 10"):
        with pytest.raises(SystemExit) as exit_:
            main(["report", str(run), "--out", str(tmp_path / "out"), "--rounds", bad])
        assert exit_.value.code == 2 and f"expected rounds from 1 like 3,10, got {bad!r}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"rounds must be whole numbers from 1 .*got 0, -1 in fedmech report --rounds"):
        write_report([run], tmp_path / "out", rounds=[0, -1, 2])
    assert not (tmp_path / "out").exists()


def test_run_folders_are_grouped_by_config_and_named_by_what_differs(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"dir_{seed}", config(seed, name=f"exp-{seed}"), accuracy=0.5 + 0.1 * seed)
        write_run(tmp_path / f"iid_{seed}", config(seed, **IID), accuracy=0.8)
    write_run(tmp_path / "mu", config(0, **PROX), accuracy=0.3)
    runs = sorted(p for p in tmp_path.iterdir())
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    labels = [g["group"] for g in summary["groups"]]
    assert labels == [
        "client=plain, label skew=dirichlet(alpha=0.05, min_samples=10), strategy=fedavg",
        "client=plain, label skew=iid, strategy=fedavg",
        "client=proximal, label skew=dirichlet(alpha=0.05, min_samples=10), strategy=fedprox(proximal_mu=0.01)",
    ]
    first = summary["groups"][0]
    assert first["stats"]["eval.accuracy"]["mean"] == pytest.approx(55.0) and first["runs"] == 2
    assert summary["differing_keys"] == ["client.name", "data.partition.alpha", "data.partition.min_samples",
                                         "data.partition.name", "strategy.name", "strategy.proximal_mu"]


def test_bad_input_names_the_file_and_key(tmp_path, capsys):
    bad = tmp_path / "values.yaml"
    bad.write_text(yaml.safe_dump({"paper": "p", "texts": {"t": {"version": "v1", "kind": "k"}}, "values": [
        {"metric": "misalignment.prob", "value": 1, "relation": "=", "where": {}, "text": "t", "quote": "y"}]}))
    with pytest.raises(ConfigError, match=r"values\[0\]\.metric.*|unknown metric 'misalignment.prob'"):
        read_paper_values(bad, declared())
    run = write_run(tmp_path / "run", config(0))
    assert main(["report", str(run), "--out", str(tmp_path / "out"), "--paper", str(bad)]) == 2
    assert "unknown metric 'misalignment.prob'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text('{"cells": [{"name": "a"}]}')
    assert main(["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 2
    assert "sweep.json: expected the manifest" in capsys.readouterr().err


def test_markdown_embeds_text_from_runs_and_values_files_as_text(tmp_path):
    """A values file's quote and a run's error cannot become HTML, a link or a table cell
    in report.md, as they cannot in index.html."""
    values = yaml.safe_load(PAPER.read_text())
    values["values"][0]["quote"] = "<script>alert(1)</script> [x](javascript:alert(2)) | cell"
    (paper := tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    sweep = make_sweep(tmp_path / "sweep")
    status = json.loads((sweep / "runs" / "dir_fedavg_s2" / "status.json").read_text())
    (sweep / "runs" / "dir_fedavg_s2" / "status.json").write_text(json.dumps(
        {**status, "error": "<iframe src=https://example.invalid></iframe>\n| a | b |"}))
    write_report([sweep], tmp_path / "out", paper_file=paper)
    md = (tmp_path / "out" / "report.md").read_text()
    for raw in ("<script", "</script>", "<iframe", " | cell", "\n| a | b |"):
        assert raw not in md, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt; \\[x\\](javascript:alert(2)) \\| cell" in md
    assert "&lt;iframe src=https://example.invalid&gt;&lt;/iframe&gt; \\| a \\| b \\|" in md
    html_page = (tmp_path / "out" / "index.html").read_text()
    assert "<script" not in html_page and "<iframe" not in html_page


def test_control_characters_from_runs_reach_neither_page_raw(tmp_path):
    """A run folder's name and a run's error with ESC, BEL, a newline and a bidi override
    show as escapes in report.md and index.html, never as the characters themselves."""
    planted = "r\x1b]0;x\x07\nb"
    done = write_run(tmp_path / planted, config(0))
    failed = write_run(tmp_path / f"f{planted}", config(1), status="failed", error="boom\x1b[2J\u202eevil\x9b")
    write_report([done, failed], tmp_path / "out")
    for page in ("report.md", "index.html"):
        text = (tmp_path / "out" / page).read_text()
        assert not CONTROL.search(text.replace("\n", "")), page
        shown = text.replace("\\", "")  # Markdown escapes the escapes' backslashes, and brackets
        assert "rx1b]0;xx07" in shown and "boomx1b[2Ju202eevilx9b" in shown, page


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")
def test_the_page_leads_with_the_claim_in_a_headless_browser(tmp_path):
    """The sweep against the product's own values file: the headline figure first, the
    protocol beside the paper's, the collapsed group flagged, no difference in points."""
    out = tmp_path / "out"
    write_report([make_sweep(tmp_path / "sweep")], out, paper_file=PAPER_VALUES)
    errors: list[str] = []
    with browser_page() as page:
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("requestfailed", lambda req: errors.append(f"failed: {req.url}"))
        page.goto((out / "index.html").as_uri())
        page.wait_for_load_state("load")
        widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
        first = page.eval_on_selector("h2", "h => [h.textContent, h.nextElementSibling.querySelector('img').alt]")
        headings = page.eval_on_selector_all("h2", "hs => hs.map(h => h.textContent)")
        headers = page.eval_on_selector_all("th", "ths => ths.map(th => th.textContent)")
        cells = page.eval_on_selector_all("td", "tds => tds.map(td => td.textContent)")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)  # kept in tmp_path: look at it
    assert errors == []
    assert len(widths) == 5 and all(w > 0 for w in widths)
    assert first[0] == "Preserved or misaligned: the headline" and first[1].startswith("global, probe, realigned")
    assert headings[1] == "Protocol" and "not stated" in cells and "paper v2" in cells
    assert "25.0 (n=1, no interval) ⚑ one class in 1/1 seeds" in cells
    assert "not shown: one class in 1/1 seeds (+15.0 pp)" in cells  # the abstract's realigned gap > 0, against chance
    assert not any("paper" in h and "−" in h for h in headers)  # no ours − paper at another protocol
    assert "label skew" in headers and "data.partition" not in headers
    assert "undefined (4 empty)" in cells and "1 of 3 completed (partial)" in cells
    assert f"{82.0:.1f} ± {T2 * 2 / math.sqrt(3):.1f} (n=3)" in cells


def test_an_undefined_iou_says_whether_empty_circuits_are_the_reason():
    iou = declared()["circuits.intra_client"]
    assert format_stat(iou, Stat(None, None, 0, undefined=2, empty=4)) == "undefined (4 empty)"
    assert format_stat(iou, Stat(None, None, 0, undefined=3, empty=0)) == "undefined in 3 runs"  # e.g. one round only
    assert format_stat(iou, Stat(0.25, 0.05, 3, empty=1)) == "0.25 ± 0.05 (n=3), 1 empty"


def test_an_all_empty_circuit_round_is_flagged_and_satisfies_no_bound(tmp_path):
    """The earlier version's controlled split (one class per client): every local circuit
    empty gives local-to-global IoU 0.00, which is emptiness, not the published < 0.3."""
    split = {"data__partition": {"name": "class_map", "classes": {0: [0], 1: [1], 2: [2]}}}
    runs = [write_run(tmp_path / f"c1_s{seed}", config(seed, **split), empty_circuits=True) for seed in (0, 1)]
    write_report(runs, tmp_path / "out", paper_file=PAPER_VALUES)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stat = summary["groups"][0]["stats"]["circuits.local_to_global"]
    assert (stat["mean"], stat["empty"], stat["flags"]) == (0.0, 6, {"mostly empty circuits": 2})
    bound = next(p for p in summary["paper"] if p["relation"] == "<")
    assert (bound["holds"], bound["result"]) == (None, "not shown: mostly empty circuits in 2/2 seeds")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "0.00 ± 0.00 (n=2), 6 empty ⚑ mostly empty circuits in 2/2 seeds" in md
    assert "intra-client" in md and "0.60 ± 0.00 (n=2), 4 empty |" in md  # 2 of 3 empty: not mostly


def spy_line_plots(monkeypatch) -> dict[str, dict]:
    """The keyword arguments of every line plot drawn from now on, by title."""
    from fedmech_flwr.artifacts import plotting

    drawn = {}
    real = plotting.line_plot

    def line_plot(lines, title, *args, **kwargs):
        drawn[title] = kwargs
        return real(lines, title, *args, **kwargs)

    monkeypatch.setattr(plotting, "line_plot", line_plot)
    return drawn


def test_the_run_plots_flag_the_rounds_of_a_one_class_model(tmp_path, monkeypatch):
    """``fedmech plot``'s accuracy curve writes the flag at each round where the global
    model predicts one class, with the rule under the axes."""
    from fedmech_flwr.artifacts import plotting

    drawn = spy_line_plots(monkeypatch)
    plotting.plot_run(write_run(tmp_path / "run", config(0), accuracy=0.25, collapsed=True))
    accuracy = drawn["Accuracy over rounds"]
    assert accuracy["notes"] == {"global model (test)": {r: "⚑ one class 100%" for r in (0, 1, 2)}}
    assert accuracy["footnote"].startswith("⚑ one class: the global model predicts one class for more than 90%")


CIRCUITS = "diagnostics=[{name: circuits, every: 1, min_class_samples: 10, ablation_samples: 40, " \
           "gates: {steps: 30, batch_size: 32, lam: %s}}]"
REAL_RUNS = {
    # one class per client, and gates so sparse that every circuit of the round is empty
    "controlled split": (["data.partition={name: class_map, classes: {0: [0], 1: [1], 2: [2]}}", CIRCUITS % 5],
                         ["global test accuracy 25.0% ⚑ one class", "local-to-global undefined ⚑ mostly empty circuits"],
                         ["⚑ one class in 1/1 seeds", "⚑ mostly empty circuits in 1/1 seeds"]),
    # alpha 0.05 and a large step: the global model collapses onto one class
    "collapsed alpha 0.05": (["data.partition={name: dirichlet, alpha: 0.05, min_samples: 10}", "train.lr=0.1",
                              CIRCUITS % 0.02], ["global test accuracy 27.0% ⚑ one class"], ["⚑ one class in 1/1 seeds"]),
}


@pytest.mark.parametrize("case", REAL_RUNS)
def test_a_real_runs_flags_travel_with_its_values_to_every_output(case, tmp_path, caplog, monkeypatch):
    """A smoke-size run in process: its flagged values are marked in the console's round
    line, the sweep's progress line, the run's accuracy plot and the report's cells."""
    from fedmech_flwr.artifacts import plotting
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.app.inprocess import run_in_process
    from fedmech_flwr.spec.experiment import load_experiment
    from fedmech_flwr.tools.sweep import headline

    plugins.load()
    sets, shown, reported = REAL_RUNS[case]
    caplog.set_level("INFO", logger="fedmech_flwr")
    run = run_in_process(load_experiment(REPO / "experiments" / "circuits_smoke.yaml",
                                         ["federation.num_rounds=1", *sets]), tmp_path / "runs")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("round 1/1 |"))
    assert all(text in line for text in shown), line
    assert all(text in headline(run) for text in shown)
    drawn = spy_line_plots(monkeypatch)
    plotting.plot_run(run)
    assert drawn["Accuracy over rounds"]["notes"]["global model (test)"][1].startswith("⚑ one class")
    write_report([run], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(text in md for text in reported)


PLUGIN = '''
from dataclasses import dataclass
from fedmech_flwr.contracts.hooks import DIAGNOSTICS, Diagnostic
from fedmech_flwr.contracts.outputs import Metric, Outputs
from fedmech_flwr.artifacts.plotting import line_plot
from fedmech_flwr.contracts.strategy import STRATEGIES


@dataclass
class GeometryConfig:
    pass


@DIAGNOSTICS.register("{name}_geometry", GeometryConfig, outputs=Outputs("Update geometry", {{
    "cosine": Metric("update cosine", ("mean", "cosine"), "cosine", 2, better="higher",
                     flag=lambda r: "no clients" if r["mean"]["clients"] == 0 else None),
}}, curves=("cosine",), headline=("cosine",)))
class Geometry(Diagnostic):
    @classmethod
    def plot(cls, records, plots_dir, class_names):
        return [line_plot({{"cosine": [(r["round"], r["mean"]["cosine"]) for r in records]}}, "cosine", "cosine",
                          plots_dir / "{name}_geometry.png")]


@STRATEGIES.register("{name}_krum", GeometryConfig, outputs=Outputs("Krum", {{
    "{name}_selected": Metric("clients Krum selected", ("{name}_selected",), "clients", 0),
}}, headline=("{name}_selected",)))
def krum(**kwargs):
    raise NotImplementedError
'''


def test_a_users_plugin_declares_what_the_report_and_plot_show(tmp_path, monkeypatch, capsys):
    """A diagnostic and a strategy from a package outside the repository, named by the
    runs' plugins:, appear in the report's tables, curves, leaderboard and summary.json,
    and in `fedmech plot`, with no core edit; a run whose plug-in is gone is named."""
    # registries are per process: fresh names, also for the strategy record's keys, which every
    # registered strategy's outputs declare (test_outputs records an undeclared krum_selected)
    name = "own" + str(abs(hash(str(tmp_path))) % 10**6)
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / f"{name}.py").write_text(PLUGIN.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path / "lab"))
    runs = []
    for seed, cosine in ((0, 0.5), (1, 0.7)):
        cfg = {**config(seed), "plugins": [name], "strategy": {"name": f"{name}_krum"}}
        run = write_run(tmp_path / f"run{seed}", cfg)
        with open(run / "metrics.jsonl", "a") as fh:
            for r in (1, 2, 3):
                fh.write(json.dumps({"kind": "diagnostic", "round": r, "name": f"{name}_geometry",
                                     "mean": {"cosine": cosine * r / 3, "clients": 3 if seed else 0}}) + "\n")
                fh.write(json.dumps({"kind": "strategy", "round": r, f"{name}_selected": 2}) + "\n")
        runs.append(run)
    importlib.import_module(name)  # as the runs' ServerApp did: each run records what its plug-ins declare
    for run in runs:
        RunFolder(run).write_outputs(declarations(), recorded_flags(declarations(), read_records(run)), {})
    gone = write_run(tmp_path / "gone", {**config(2), "plugins": [f"{name}_missing"]})  # from before runs recorded them
    write_report([*runs, gone], tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stats = next(g for g in summary["groups"] if g["completed"] == 2)["stats"]
    assert stats[f"{name}_geometry.cosine"]["mean"] == pytest.approx(0.6)
    assert stats[f"{name}_geometry.cosine"]["flags"] == {"no clients": 1}
    assert stats[f"strategy.{name}_selected"]["mean"] == pytest.approx(2.0)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Update geometry" in md and "0.60 ± " in md and "⚑ no clients in 1/2 seeds" in md
    assert "## Strategy metrics" in md and "clients Krum selected" in md
    assert f"plots/{name}_geometry_cosine.png" in md  # its declared curve
    assert "## Runs that recorded no declarations" in md and "gone recorded no declarations" in md
    assert main(["plot", str(runs[0])]) == 0
    assert f"{name}_geometry.png" in capsys.readouterr().out
    write_report([runs[0]], tmp_path / "page")  # the run's page: its plug-in's own plot, under its name
    page = (tmp_path / "page" / "report.md").read_text()
    assert f"## Plots of {name}_geometry" in page and f"{name}_geometry: {name}_geometry.png" in page
    assert main(["plot", str(gone)]) == 0
    assert f"gone recorded no declarations (a folder from before runs did): its plug-ins' ({name}_missing)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("fraction, flagged", [(1.0, True), (0.3, False)])
def test_the_consoles_round_line_flags_a_one_class_model(caplog, fraction, flagged):
    """The round line shows the round's declared headline metrics with their flags."""
    from types import SimpleNamespace

    from fedmech_flwr.app.run import Run
    from fedmech_flwr.learning.training import EvalResult

    evaluated = {"kind": "eval", "round": 2, "accuracy": 0.1, "max_predicted_class": 3,
                 "max_predicted_fraction": fraction}
    probed = {"kind": "diagnostic", "round": 2, "name": "misalignment", "probe": {"accuracy": 0.366}}
    run = SimpleNamespace(protocol=SimpleNamespace(current=SimpleNamespace(started_at=0.0, succeeded=[0], sampled=[0])),
                          cfg=SimpleNamespace(federation=SimpleNamespace(num_rounds=3)),
                          folder=SimpleNamespace(recent=[evaluated, probed]), _eta=lambda server_round: "")
    with caplog.at_level("INFO", logger="fedmech_flwr.app.run"):
        Run._log(run, 2, EvalResult(2.3, 0.1, [1.0] + [0.0] * 9, 1000, 3, fraction), 0.9)
    line = caplog.records[-1].getMessage()
    accuracy = "global test accuracy 10.0%" + (" ⚑ one class" if flagged else "")
    assert line.startswith(f"round 2/3 | {accuracy} | probe 36.6% | loss 2.3000 | sparsity 90.00% | clients 1/1 | ")


def test_a_value_that_rounds_to_zero_is_never_minus_zero():
    gap = declared()["misalignment.gaps.probe"]
    assert format_stat(gap, Stat(-0.0004, 0.01, 3)) == "+0.0 ± 0.0 pp (n=3)"


def test_dense_runs_are_the_headline_control_only_beside_pruned_ones(tmp_path, monkeypatch):
    """A panel whose runs are all dense (the leaderboard) has no control series: every
    group is drawn as a measurement; with pruned runs beside them, the dense ones are."""
    from fedmech_flwr.tools.report import Group, figures, plot_headline

    drawn = []
    real_level_plot = figures.level_plot
    monkeypatch.setattr(figures, "level_plot", lambda panels, *a, **k: drawn.append(panels) or real_level_plot(
        panels, *a, **k))

    def made(mode: str, partition: dict, accuracy: float, seed: int = 0) -> Group:
        cfg = {**config(seed, data__partition=partition), "pruning": {"mode": mode}}
        return Group(f"{mode}_{partition['name']}", {}, cfg, [], {"misalignment.global": Stat(accuracy, 1.0, 3)})

    skews = ({"name": "iid"}, {"name": "dirichlet", "alpha": 0.05})
    dense = [made("dense", skew, 80.0 - 40 * i) for i, skew in enumerate(skews)]
    ((_, caption),) = plot_headline(dense, [], tmp_path / "dense", None)
    assert "dense control" not in caption and list(drawn[-1][0].series) == [("global", False)]
    pruned = [made("magnitude", skew, 78.0 - 40 * i) for i, skew in enumerate(skews)]
    other = [made("dense", skew, 70.0 - 40 * i, seed=1) for i, skew in enumerate(skews)]  # a panel of its own
    ((_, caption),) = plot_headline(dense + pruned + other, [], tmp_path / "both", None)
    assert "hollow squares and dashed lines: the dense control" in caption
    assert [sorted(panel.series) for panel in drawn[-1]] == [[("global", False), ("global", True)],
                                                            [("global", False)]]


def test_identical_curves_share_one_line_and_one_legend_entry(tmp_path, monkeypatch):
    """The misalignment plot's seven heads often coincide (realigned and its test-selected
    twin, tau-norm and global): a curve hidden under another would leave a legend entry
    with no visible line."""
    from matplotlib.figure import Figure

    from fedmech_flwr.artifacts import plotting

    drawn = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: drawn.append(fig) or path)
    same = [(1, 0.5), (2, 0.6)]
    plotting.line_plot({"realigned": same, "realigned test selected": list(same), "probe": [(1, 0.7), (2, 0.8)]},
                       "heads", "test accuracy", tmp_path / "x.png")
    [fig] = drawn
    assert isinstance(fig, Figure)
    [ax] = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["realigned = realigned test selected", "probe"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["realigned = realigned test selected", "probe"]


def test_curves_put_each_method_beside_its_own_control_in_one_panel(tmp_path, monkeypatch):
    """Groups that differ in their skew and their method: one panel per method, a line per
    skew level in the same colour in every panel, one legend; a flagged seed is ringed in
    its own panel only."""
    from fedmech_flwr.artifacts import plotting

    drawn, real = {}, plotting.save_figure
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: real(drawn.setdefault(path.name, fig), path))
    write_report([make_sweep(tmp_path / "sweep")], tmp_path / "out")
    fig = drawn["eval_accuracy.png"]
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert list(panels) == ["fedavg", "fedprox"]
    colours = {title: {line.get_label(): line.get_color() for line in ax.get_lines()} for title, ax in panels.items()}
    assert list(colours["fedavg"]) == ["IID", "α=0.05", "one class (ringed)"]  # dir_fedavg_s0 is a one-class model
    assert list(colours["fedprox"]) == ["α=0.05"]
    assert colours["fedprox"]["α=0.05"] == colours["fedavg"]["α=0.05"] != colours["fedavg"]["IID"]
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["IID", "α=0.05", "one class (ringed)"]


def test_the_panels_legend_lists_every_series_before_the_rings(tmp_path, monkeypatch):
    """A ring in the first panel and a series first seen in the second: the legend still
    reads series, then rings."""
    from fedmech_flwr.artifacts import plotting

    drawn, real = [], plotting.save_figure
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: real(drawn.append(fig) or fig, path))
    points = [(r, 50.0 + r, 48.0 + r, 52.0 + r) for r in (0, 5, 10)]
    plotting.band_panels({"fedavg": {"IID": points}, "fedetf": {"IID": points, "α=0.05": points}}, "accuracy",
                         "accuracy (%)", tmp_path / "panels.png", flagged={("fedavg", "IID"): {5}},
                         flag_label="one class (ringed)")
    [fig] = drawn
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["IID", "α=0.05", "one class (ringed)"]


def test_the_published_values_appear_only_beside_groups_they_describe(tmp_path):
    """The paper's values sit on a page only where a group's config is in a value's
    `where` (its dataset, partition, strategy): a user's own Krum run under a Dirichlet
    0.5 skew gets no "Published values" section and none of its footnotes."""
    paper_run = write_run(tmp_path / "fedavg", config(0))  # CIFAR-10, Dirichlet 0.05, FedAvg: the paper's cells
    own = write_run(tmp_path / "krum", config(0, strategy={"name": "krum"},
                                              data__partition={"name": "dirichlet", "alpha": 0.5, "min_samples": 10}))
    write_report([paper_run], tmp_path / "paper", paper_file=PAPER_VALUES)
    write_report([own], tmp_path / "own", paper_file=PAPER_VALUES)
    assert "## Published values" in (tmp_path / "paper" / "report.md").read_text()
    assert "## Published values" not in (tmp_path / "own" / "report.md").read_text()


def test_the_pages_words_are_plain(tmp_path):
    """No "preset none" for a sweep without one, "1 run" not "1 runs", no 95% interval
    claimed over a single seed, and "val-selected" said in words."""
    iou = declared()["circuits.intra_client"]
    assert format_stat(iou, Stat(None, None, 0, undefined=1, empty=0)) == "undefined in 1 run"
    root = tmp_path / "sweep"
    cells = []
    for partition, label in (({"name": "iid"}, "iid"), ({"name": "dirichlet", "alpha": 0.05, "min_samples": 10},
                                                         "dir0.05")):
        cfg = config(0, data__partition=partition)
        write_run(root / "runs" / f"{label}_s0", cfg)
        cells.append({"name": f"{label}_s0", "run_dir": f"runs/{label}_s0", "status": "completed", "seed": 0,
                      "group": label, "axes": {"data.partition": label}, "config": cfg})
    (root / "sweep.json").write_text(json.dumps({"name": "one-seed", "preset": None, "axes": ["data.partition"],
                                                 "cells": cells}))
    write_report([root], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "preset none" not in md and "no preset (the file's own settings)" in md
    assert "one seed, so no interval" in md and "95% interval over seeds" not in md
    assert "val-selected: the epoch of a retrained head picked by its accuracy on a validation split" in md
