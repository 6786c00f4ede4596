"""matched_avg and circuit_masked_avg through a real ``fedmech run`` (SuperLink, Ray) at
smoke size, with the circuits and misalignment diagnostics on every round: each completes,
both diagnostics record every round, and the strategy reports what it did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedmech_flwr.artifacts.folder import read_records, read_status

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration

DIAGNOSTICS = (
    "diagnostics=[{name: circuits, every: 1, gates: {steps: 20, batch_size: 32, lam: 0.02}, min_class_samples: 10, "
    "ablation_samples: 40, ablations: []}, {name: misalignment, every: 1, head_samples: 20}]"
)


@pytest.mark.parametrize(("strategy", "logged"), [
    ("{name: matched_avg}", "round 2: matched_avg moved"),
    ("{name: circuit_masked_avg}", "round 2: circuit_masked_avg (circuits) channels per layer"),
])
def test_a_circuit_aware_strategy_completes_with_both_diagnostics(strategy, logged, tmp_path):
    cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", "experiments/circuits_smoke.yaml", "--out", str(tmp_path)]
    for item in (f"strategy={strategy}", "data.audit_per_class=10", DIAGNOSTICS):
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert read_status(run_dir)["status"] == "completed"
    diagnostics = read_records(run_dir, "diagnostic")
    assert sorted((r["name"], r["round"]) for r in diagnostics) == [
        ("circuits", 1), ("circuits", 2), ("misalignment", 1), ("misalignment", 2)]
    assert logged in (run_dir / "logs" / "flwr_run.log").read_text()  # the whole log; the console is quiet
