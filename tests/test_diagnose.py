"""``fedmech diagnose``: a diagnostic rerun with other settings on a finished run's saved
rounds, its records beside the run's own (never touching them), shown by every view, and
its refusals of what a run folder cannot give."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import DIAGNOSES_FILE, read_records
from fedmech_flwr.artifacts.reader import read_run
from fedmech_flwr.builtin.diagnostics.misalignment import Misalignment, MisalignmentConfig
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.status import run_status

MISALIGNMENT = "diagnostics=[{name: misalignment, head_samples: 20, rounds: [1, 2]}]"


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory) -> Path:
    """A completed in-process run with the misalignment diagnostic after rounds 1 and 2
    (read-only: tests copy it)."""
    from conftest import smoke_config

    cfg = smoke_config(["data.audit_per_class=15", "federation.checkpoint_every=5", MISALIGNMENT])
    return run_in_process(cfg, tmp_path_factory.mktemp("probed"))


def digests(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_rerun_with_the_pooled_probe_lands_beside_the_records_and_every_view_shows_it(probed_run, tmp_path,
                                                                                         capsys):
    run = shutil.copytree(probed_run, tmp_path / "run")
    before = digests(run)
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--set", "pooled_probe=selected"]) == 0
    out = capsys.readouterr().out
    assert "round 2, misalignment@pooled_probe=selected: " in out and "pooled-data probe [pooled_probe=selected]" in out
    after = digests(run)
    assert {k: v for k, v in after.items() if k in before} == before  # the run's own files untouched
    assert set(after) - set(before) == {DIAGNOSES_FILE, f".{DIAGNOSES_FILE}.lock"}

    reruns = read_records(run, file=DIAGNOSES_FILE)
    own = [r for r in read_records(run, "diagnostic") if r["name"] == "misalignment"]
    assert [(r["name"], r["round"]) for r in reruns] == [("misalignment@pooled_probe=selected", 1),
                                                         ("misalignment@pooled_probe=selected", 2)]
    for mine, theirs in zip(reruns, own):
        assert mine["settings"]["pooled_probe"] == "selected" and mine["settings"]["head_samples"] == 20
        # its flags, by the diagnostic's rules, travel in the record (this tiny model predicts one class)
        assert mine["flags"]["global"] == "one class" and mine["flags"]["gaps.probe_pooled"].startswith("one class")
        assert ("under-powered" in mine["flags"].get("probe_pooled", "")) == mine["probe_pooled"]["under_powered"]
        assert mine["global"] == theirs["global"]  # the same saved model, the same test set
        assert mine["probe"]["accuracy"] == theirs["probe"]["accuracy"]  # and the same seeded audit probe
        assert "simulation-only" in mine["probe_pooled"]["note"]

    # a second rerun under the same label replaces its rounds, never the run's own records
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--set", "pooled_probe=selected",
                 "--rounds", "2"]) == 0
    assert [r["round"] for r in read_records(run, file=DIAGNOSES_FILE)] == [1, 2]

    assert "pooled-data probe [pooled_probe=selected]" in run_status(run)
    assert "pooled probe − global [pooled_probe=selected] " in run_status(run)
    assert run_status(run).split("pooled probe − global [pooled_probe=selected] ")[1].split(" | ")[0].endswith(
        f"⚑ {reruns[-1]['flags']['gaps.probe_pooled']}")
    assert main(["export", str(run), "--out", str(tmp_path / "runs.csv")]) == 0
    with open(tmp_path / "runs.csv") as fh:
        records = {row["record"] for row in csv.DictReader(fh)}
    assert {"misalignment", "misalignment@pooled_probe=selected"} <= records
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "rerun as pooled_probe=selected (fedmech diagnose)" in page
    assert "undeclared" not in page


def test_a_run_keeps_the_model_of_every_diagnosed_round_and_diagnose_names_what_it_lacks(probed_run, tmp_path,
                                                                                         capsys):
    assert sorted(p.name for p in (probed_run / "checkpoints").glob("round_*")) == ["round_001.safetensors",
                                                                                  "round_002.safetensors"]
    run = shutil.copytree(probed_run, tmp_path / "run")
    (run / "checkpoints" / "round_001.safetensors").unlink()
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--rounds", "1"]) == 2
    assert "holds no model of round(s) [1]; it has rounds 2" in capsys.readouterr().err
    assert main(["diagnose", str(run), "--diagnostic", "misalignmnet"]) == 2
    assert "did you mean 'misalignment'" in capsys.readouterr().err
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--set", "pooled_probe=oracle"]) == 2
    assert "pooled_probe" in capsys.readouterr().err
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--set", "client_stats=[ncm]"]) == 2
    assert "needs a round trip to the clients" in capsys.readouterr().err
    assert main(["diagnose", str(run), "--diagnostic", "misalignment", "--as", "../x"]) == 2
    assert not (run / DIAGNOSES_FILE).exists()


def test_a_run_that_did_not_complete_is_skipped_with_its_state(probed_run, tmp_path, capsys):
    run = shutil.copytree(probed_run, tmp_path / "run")
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "status": "failed", "error": "planted"}))
    assert read_run(run).status == "failed"
    assert main(["diagnose", str(run), "--diagnostic", "misalignment"]) == 1
    assert "skipped, it is failed" in capsys.readouterr().err
    assert not (run / DIAGNOSES_FILE).exists()


def test_the_pooled_probe_is_refused_in_a_users_own_flower_app(separable_cnn):
    from fedmech_flwr.app.flower import WithDiagnostics
    from fedmech_flwr.foundation.errors import ConfigError
    from flwr.serverapp.strategy import FedAvg

    model, data = separable_cnn
    assert Misalignment(MisalignmentConfig(pooled_probe="paper")).needs_pooled_data()
    with pytest.raises(ConfigError, match="trains on every client's data pooled"):
        WithDiagnostics(FedAvg(), lambda: model, {"diagnostics": [{"name": "misalignment", "pooled_probe": "paper"}]},
                        test=(data.x_test, data.y_test), audit=(data.x_train, data.y_train))
