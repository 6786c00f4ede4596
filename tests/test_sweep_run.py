"""``fedmech sweep`` through real ``flwr run``: a 2-axis x 2-seed sweep on synthetic data,
stopped with SIGTERM, continued, killed with SIGKILL, continued again, must end as the
same sweep run uninterrupted (two cells at a time): cells, records, weights and report;
and each cell as a lone ``fedmech run`` of it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_gone, assert_same_run, launch_processes_of, once_per_session
from fedmech_flwr.artifacts.folder import STATE_FILE
from fedmech_flwr.tools.report import write_report

pytestmark = pytest.mark.integration
CELLS = ["iid_fedavg_s0", "iid_fedavg_s1", "dir0.5_fedavg_s0", "dir0.5_fedavg_s1"]


def sweep_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fedmech_flwr.tools.cli", "sweep", "experiments/smoke_sweep.yaml", "--out", str(out),
            "--only", "strategy+client=fedavg", *extra]


def start_and_stop_at(out: Path, cell: str, sig: signal.Signals) -> subprocess.Popen:
    """Start the sweep, send ``sig`` once ``cell`` has committed a round, and check that
    within 10 s nothing the sweep started is alive."""
    proc = subprocess.Popen(sweep_command(out), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = out / "smoke-sweep" / "runs" / cell / STATE_FILE
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not state.exists():
        time.sleep(0.05)
    assert proc.poll() is None, f"the sweep ended before {cell} could be stopped:\n{proc.stdout.read()}"
    started = launch_processes_of(proc.pid)
    assert started, "no process of the sweep's launches was found"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert_gone(started, 10, "processes of the stopped sweep are still alive")
    return proc


def mtimes(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The sweep run uninterrupted, two cells at a time (made once per session)."""
    def make(out: Path) -> None:
        done = subprocess.run(sweep_command(out, "--parallel", "2"), cwd=REPO, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "[4/4]" in done.stdout and "4 of 4 cell(s) run now completed" in done.stdout

    return once_per_session(tmp_path_factory, "uninterrupted-sweep", make) / "smoke-sweep"


def test_stopped_killed_and_continued_sweep_ends_as_the_uninterrupted_one(reference, tmp_path):
    folder = tmp_path / "smoke-sweep"
    # 1. SIGTERM (a scheduler's stop; Ctrl-C goes the same way) during the first cell.
    term = start_and_stop_at(tmp_path, CELLS[0], signal.SIGTERM)
    assert term.returncode == 128 + signal.SIGTERM
    cells = {c["name"]: c for c in json.loads((folder / "sweep.json").read_text())["cells"]}
    assert cells[CELLS[0]]["status"] == "interrupted" and cells[CELLS[1]]["status"] == "pending"
    assert not (folder / "sweep.lock").exists()

    # 2. Continue; SIGKILL the sweep alone (not its process group) during the second cell.
    start_and_stop_at(tmp_path, CELLS[1], signal.SIGKILL)
    first = mtimes(folder / "runs" / CELLS[0])
    assert json.loads((folder / "runs" / CELLS[0] / "status.json").read_text())["status"] == "completed"

    # 3. Continue to the end: the completed cell is left alone, the killed one resumed.
    done = subprocess.run(sweep_command(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "4 cells in" in done.stdout and "1 completed, 1 to resume, 2 to start, 0 failed before" in done.stdout
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("[")] == CELLS[1:]
    assert mtimes(folder / "runs" / CELLS[0]) == first
    assert "Resuming" in (folder / "logs" / f"{CELLS[1]}.log").read_text()

    for cell in CELLS:
        assert_same_run(reference / "runs" / cell, folder / "runs" / cell)
    write_report([reference], tmp_path / "report-reference")
    write_report([folder], tmp_path / "report")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary == json.loads((tmp_path / "report-reference" / "summary.json").read_text())
    assert [g["completed"] for g in summary["groups"]] == [2, 2]


def test_warm_cells_end_as_lone_runs_of_the_same_cells(reference, tmp_path):
    """A sweep's worker runs its cells on one SuperLink and Ray (four cells on two workers
    here: two SuperLinks, each taking a second cell once its first has ended); each such
    warm cell is still its own Flower run and ends bitwise as a lone ``fedmech run`` of its
    settings (records and weights), at both seeds."""
    manifest = json.loads((reference / "sweep.json").read_text())
    superlinks = {c: re.search(r"Using SuperLink: \S+ \((\S+)\)", (reference / "runs" / c / "logs" / "flwr_run.log")
                               .read_text()).group(1) for c in CELLS}
    assert len(set(superlinks.values())) == 2, superlinks
    assert {superlinks[c] for c in CELLS[:2]} == {superlinks[c] for c in CELLS[2:]}, superlinks  # the last two ran warm
    for cell in (c for c in manifest["cells"] if c["name"] in CELLS[2:]):
        out = tmp_path / cell["name"]
        sets = [arg for item in cell["overrides"] for arg in ("--set", item)]
        done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "run", manifest["base"], *sets,
                               "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        (lone,) = out.iterdir()
        assert_same_run(reference / "runs" / cell["name"], lone)
