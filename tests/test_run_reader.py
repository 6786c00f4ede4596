"""The one reader of run and sweep folders and its one liveness rule: a writer on this host
is alive or gone (its pid checked), one on another host is named and not checked; and
``fedmech status``, ``fedmech report`` and ``fedmech export`` give the same answer."""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import config, group, make_sweep, write_run

from fedmech_flwr.artifacts.folder import RunFolder, read_outputs, read_records
from fedmech_flwr.artifacts.liveness import FolderLock, live_holder, writer_alive, writer_gone, writer_of
from fedmech_flwr.artifacts.reader import read_run, read_sweep
from fedmech_flwr.contracts.outputs import declarations, recorded_flags
from fedmech_flwr.foundation.errors import BadFileError
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.report import write_report

HOST = socket.gethostname()


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_the_liveness_rule_alive_gone_or_on_another_host():
    assert writer_of({}) is None and writer_of({"status": "completed"}) is None
    alive = writer_of({"pid": os.getpid(), "host": HOST, "since": "t"})
    assert (alive.state, alive.where, alive.since) == ("alive", f"pid {os.getpid()} on {HOST}", "t")
    assert writer_of({"pid": dead_pid(), "host": HOST}).state == "gone"
    elsewhere = writer_of({"pid": os.getpid(), "host": "gpu-7"})  # a live pid here says nothing of gpu-7's
    assert (elsewhere.state, elsewhere.where) == ("elsewhere", f"on gpu-7 (pid {os.getpid()}), not checked from here")
    running = {"status": "running", "pid": dead_pid(), "host": HOST}
    assert writer_gone(running) and not writer_alive(running)
    assert not writer_gone({**running, "host": "gpu-7"}) and not writer_alive({**running, "host": "gpu-7"})
    assert writer_alive({**running, "pid": os.getpid()}) and not writer_gone({**running, "status": "failed"})


def test_a_lock_of_another_host_is_taken_over_with_a_warning(tmp_path, caplog):
    lock_file = tmp_path / "run" / "run.lock"
    lock_file.parent.mkdir()
    lock_file.write_text(json.dumps({"pid": 7, "host": "gpu-7", "since": "2025-01-02T03:04:05+00:00"}))
    assert live_holder(lock_file) is None  # not alive here: a writer may take it over, but not silently
    with caplog.at_level(logging.WARNING, logger="fedmech_flwr.artifacts.folder"), FolderLock(lock_file, "retry"):
        assert live_holder(lock_file)["pid"] == os.getpid()
    assert f"taking over {lock_file}, held by a process on gpu-7 (pid 7), not checked from here" in caplog.text
    assert not lock_file.exists()


def plant(sweep: Path, lock: dict, cell: dict) -> None:
    """Replace the sweep's lock and its running cell's (dir_fedavg_s1) status.json."""
    (sweep / "sweep.lock").write_text(json.dumps(lock))
    status = sweep / "runs" / "dir_fedavg_s1" / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), **cell}))


@pytest.mark.parametrize("where", ["another host", "this host, gone"])
def test_status_report_and_export_say_the_same_of_a_sweep_and_a_run(tmp_path, capsys, where):
    """A sweep.lock and a running cell's status.json written on another host: running
    there, not checked from here, in every command (the report used to call the cell
    killed); written on this host by processes that are gone: interrupted in every one
    (the report's reason: its sweep was killed, which the same sweep command continues)."""
    sweep = make_sweep(tmp_path / "sweep")
    if where == "another host":
        plant(sweep, {"pid": 4242, "host": "gpu-7", "since": "t"}, {"status": "running", "pid": 7, "host": "gpu-7"})
        state, cell_text = "running", "on gpu-7 (pid 7), not checked from here"
        sweep_line = "sweep misalign-v2: running (on gpu-7 (pid 4242), not checked from here)"
    else:
        pid = dead_pid()
        plant(sweep, {"pid": pid, "host": HOST}, {"status": "running", "pid": pid, "host": HOST})
        state, cell_text = "interrupted", "its sweep was killed; run the same `fedmech sweep` command again"
        sweep_line = "sweep misalign-v2: interrupted (no `fedmech sweep` runs it)"

    read = read_sweep(sweep)
    assert read.writer.state == ("elsewhere" if where == "another host" else "gone")
    assert read.cells["dir_fedavg_s1"].status == state and read.state == state

    main(["status", str(sweep)])
    out = capsys.readouterr().out
    assert sweep_line in out
    if state == "running":
        assert f"dir_fedavg_s1: running {cell_text}, round 1 of 2" in out
    else:
        assert f"dir_fedavg_s1: interrupted: status.json says running, but its process {pid} is gone" in out

    write_report([sweep], tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [c["status"] for c in group(summary, "dir_fedavg")["cells"]] == ["completed", state, "failed"]
    md = (tmp_path / "out" / "report.md").read_text().replace("\\", "")
    assert f"dir_fedavg_s1 (group dir_fedavg, seed 1): {state}: {cell_text}" in md
    assert where == "this host, gone" or "its sweep was killed" not in md

    assert main(["export", str(sweep), "--out", str(tmp_path / "out.csv")]) == 0
    with open(tmp_path / "out.csv", newline="") as fh:
        statuses = {row["status"] for row in csv.DictReader(fh) if row["run"] == "dir_fedavg_s1"}
    assert statuses == {state}

    run = sweep / "runs" / "dir_fedavg_s1"  # the run folder alone says the same
    assert read_run(run).status == state
    main(["status", str(run)])
    assert f"run dir_fedavg_s1: {state}" in capsys.readouterr().out


def test_a_cell_the_manifest_failed_keeps_both_reasons(tmp_path):
    """The sweep's reason where it holds the run's own (it adds the log), else both."""
    sweep = make_sweep(tmp_path / "sweep")
    cell = read_sweep(sweep).cells["dir_fedavg_s2"]
    assert (cell.status, cell.error) == ("failed", "round 2: test loss is nan (diverged) (sweep: exit 1)")


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded declarations", "folder from before them"])
def test_every_reader_reads_a_folder_without_running_the_modules_it_names(recorded, tmp_path, monkeypatch, capsys):
    """A run folder whose config names a module with an import side effect (it writes a
    file) is read by status, report (the page), export and plot without importing it, with
    its recorded declarations or, in a folder from before them, the built-ins'; only
    `fedmech plot --plugin` imports it, and says so."""
    lab, ran = tmp_path / "lab", tmp_path / "it ran"
    lab.mkdir()
    (lab / "side_effect_lab.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).write_text('imported')\n")
    monkeypatch.syspath_prepend(str(lab))
    run = write_run(tmp_path / "run", {**config(0), "plugins": ["side_effect_lab"]})
    if recorded:
        RunFolder(run).write_outputs(declarations(), recorded_flags(declarations(), read_records(run)), {})
    assert main(["status", str(run)]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "runs.csv")]) == 0
    assert main(["plot", str(run)]) == 0
    said = capsys.readouterr()
    assert not ran.exists() and "side_effect_lab" not in sys.modules
    assert ("recorded no declarations" in said.err) is not recorded
    assert "misalignment.gaps.probe" in (tmp_path / "runs.csv").read_text()  # a built-in diagnostic's, as declared
    assert main(["plot", str(run), "--plugin", "side_effect_lab"]) == 0
    assert ran.exists() and "importing side_effect_lab to draw its plots (--plugin)" in capsys.readouterr().err
    del sys.modules["side_effect_lab"]  # imported as asked: another test must import it afresh


def test_a_run_records_its_declarations_and_flags(smoke_run):
    """What a real run records: every declared output, and the flag of each flagged value
    (the smoke run's round 0 predicts one class)."""
    declared, flags, _ = read_outputs(smoke_run)
    assert {"eval", "weight_divergence"} <= set(declared)
    assert declared["eval"]["metrics"]["accuracy"]["label"] == "global test accuracy"
    assert declared["eval"]["metrics"]["accuracy"]["flagged"] is True
    assert flags.get("eval.accuracy", {}).get("0") == "one class"


def test_a_sweep_json_whose_run_dir_leads_out_of_its_folder_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"name": "s", "cells": [{"name": "a", "run_dir": "../../etc"}]}))
    with pytest.raises(BadFileError, match="leads out of the sweep folder"):
        read_sweep(sweep)
