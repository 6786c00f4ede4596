"""End to end through real ``flwr run`` (SuperLink, Ray): the path users take.

Each run costs about 30-40 s on 2 cores (Ray start-up), so there are two: one that must
complete, and one that must be reported as failed although ``flwr run`` itself exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedmech_flwr.run_folder import read_records, read_status

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def fedmech_run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fedmech_flwr.cli", "run", "experiments/smoke.yaml", "--out", str(out)]
    for item in ("federation.num_clients=2", "federation.num_rounds=2", *overrides):
        cmd += ["--set", item]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_flwr_run_completes_and_writes_the_run_folder(tmp_path):
    done = fedmech_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "finished:completed" in done.stdout
    (run_dir,) = list(tmp_path.iterdir())
    assert read_status(run_dir)["status"] == "completed"
    assert f"Run folder: {run_dir}" in done.stdout
    evals = read_records(run_dir, "eval")
    assert [r["round"] for r in evals] == [0, 1, 2]
    clients = read_records(run_dir, "client")
    assert sorted((r["round"], r["partition_id"]) for r in clients) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # One progress line per round reached the user through Flower's log stream.
    assert "round 2/2 | test acc" in done.stdout
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["packages"]["flwr"].startswith("1.42")


def test_a_failed_run_is_reported_as_failed(tmp_path):
    done = fedmech_run(tmp_path, "data.dataset={name: fashion_mnist, root: /nonexistent/fmnist}")
    assert done.returncode == 1, done.stdout[-4000:]
    assert "finished:failed" in done.stdout
    assert "/nonexistent/fmnist" in done.stdout  # the server's error reached the user
    assert not list(tmp_path.iterdir()), "a run that failed on bad input must leave no run folder"
