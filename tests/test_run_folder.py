"""run_folder.py on its own: records, one-line reasons, locks, resume points, rewinds."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from fedmech_flwr.app.protocol import one_line
from fedmech_flwr.artifacts.folder import (
    CHECKPOINT_DIR, FINAL_MODEL_FILE, METRICS_FILE, ResumePoint, RunFolder, read_records, round_file,
)
from fedmech_flwr.artifacts.liveness import FolderLock, live_holder
from fedmech_flwr.foundation.errors import BadFileError, RunFolderError


def test_records_come_back_in_order_and_by_kind(tmp_path):
    folder = RunFolder.create(tmp_path, "x", tmp_path / "run")
    folder.eval(0, {"accuracy": 0.5})
    folder.failure(1, 2, "ValueError: bad", "continue", details="Traceback ...\nValueError: bad")
    folder.eval(1, {"accuracy": float("nan")})
    records = read_records(folder.path)
    assert [(r["kind"], r["round"]) for r in records] == [("eval", 0), ("failure", 1), ("eval", 1)]
    assert np.isnan(read_records(folder.path, "eval")[1]["accuracy"])
    assert records[1]["details"] == "logs/client_failures.log"
    assert "round 1, client 2" in (folder.path / "logs/client_failures.log").read_text()


def test_environment_names_the_commit_of_the_checkout_the_run_started_from(tmp_path, monkeypatch):
    """Flower runs the app from an unpacked copy without .git: the commit comes from
    ``$FEDMECH_PROJECT_DIR``, the checkout ``fedmech run`` was started from."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMECH_PROJECT_DIR", str(REPO))
    folder = RunFolder.create(tmp_path, "x", tmp_path / "run")
    folder.write_environment(0, "cpu", {})
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert json.loads((folder.path / "environment.json").read_text())["git"]["commit"] == head


def test_a_torn_last_line_is_skipped_but_a_bad_line_before_it_is_an_error(tmp_path, caplog):
    folder = RunFolder.create(tmp_path, "x", tmp_path / "run")
    folder.eval(0, {"accuracy": 0.5})
    metrics = folder.path / METRICS_FILE
    with open(metrics, "a") as fh:
        fh.write('{"kind": "eval", "rou')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["round"] for r in read_records(folder.path)] == [0]
    assert "torn last line 2" in caplog.text
    metrics.write_text('{"kind": "eval", "rou\n{"kind": "eval", "round": 1}\n')
    with pytest.raises(BadFileError, match="line 1: expected one JSON record per line"):
        read_records(folder.path)
    metrics.write_text('{"kind": "eval", "round": "1"}\n')  # JSON, but not a record
    with pytest.raises(BadFileError, match="line 1: expected a record"):
        read_records(folder.path)


@pytest.mark.parametrize(("text", "line"), [
    ("\x1b[31mTraceback (most recent call last):\n  File x\nray.exceptions.RayTaskError(ValueError): wrapped\n"
     "\nValueError: labels out of range\x1b[0m", "ValueError: labels out of range"),
    ("<class 'flwr.clientapp.ClientAppException'>:<'RuntimeError: node is out of memory'>",
     "RuntimeError: node is out of memory"),
    ("<class 'builtins.KeyError'>:<''x_val''>", "KeyError: 'x_val'"),  # str(KeyError) is quoted
    ("", "(no reason given)"),
    ("E: " + "x" * 300, "E: " + "x" * 194 + "..."),
])
def test_one_line_keeps_the_clients_own_exception(text, line):
    assert one_line(text) == line


def test_a_lock_refuses_a_live_holder_takes_over_a_stale_one_and_leaves_no_folder(tmp_path):
    lock_file = tmp_path / "new" / "run.lock"
    with FolderLock(lock_file, "run it again"):
        assert live_holder(lock_file)["pid"] == os.getpid()
        with pytest.raises(RunFolderError, match=f"process {os.getpid()} .* then run it again"):
            FolderLock(lock_file, "run it again").__enter__()
    assert not lock_file.parent.exists()  # the lock made the folder and nothing else wrote into it

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_file.parent.mkdir()
    lock_file.write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    assert live_holder(lock_file) is None
    with FolderLock(lock_file, "again"):
        assert live_holder(lock_file)["pid"] == os.getpid()
    assert lock_file.parent.is_dir() and not lock_file.exists()  # a folder it did not make stays


def test_a_run_folder_is_resumed_only_when_killed_or_failed(tmp_path):
    with pytest.raises(RunFolderError, match="not a fedmech run folder"):
        RunFolder.resume(tmp_path)
    folder = RunFolder.create(tmp_path, "x", tmp_path / "run")
    folder.write_config({"name": "x"})
    with pytest.raises(RunFolderError, match=f"still being written by process {os.getpid()}"):
        RunFolder.resume(folder.path)
    folder.set_status("completed")
    with pytest.raises(RunFolderError, match="completed run"):
        RunFolder.resume(folder.path)
    folder.set_status("failed", error="boom")
    assert RunFolder.resume(folder.path).path == folder.path
    with pytest.raises(FileExistsError, match="not empty"):
        RunFolder.create(tmp_path, "x", folder.path)


def test_rewind_forgets_later_rounds_and_checkpoints_restore_their_round(tmp_path):
    folder = RunFolder.create(tmp_path, "x", tmp_path / "run")
    assert folder.load_state() is None
    for r in range(3):
        weights = {"w": np.full(2, float(r), dtype=np.float32)}
        folder.eval(r, {"accuracy": r / 10})
        folder.checkpoint(r, weights, {"strategy/m": np.asarray([r])})
        folder.save_state(ResumePoint(r, weights, {"strategy/m": np.asarray([r])}))
    folder.final_model({"w": np.zeros(2, dtype=np.float32)})
    assert folder.checkpoint_rounds() == [0, 1, 2] and folder.load_state().last_round == 2

    folder.restore_checkpoint(1)
    point = folder.load_state()
    assert point.last_round == 1 and point.global_arrays["w"].tolist() == [1.0, 1.0]
    assert point.protocol_state["strategy/m"].tolist() == [1]
    folder.rewind(point.last_round)
    assert [r["round"] for r in read_records(folder.path)] == [0, 1]
    assert not (folder.path / CHECKPOINT_DIR / round_file(2)).exists()
    assert not (folder.path / FINAL_MODEL_FILE).exists()
    with pytest.raises(RunFolderError, match="no checkpoint of round 5 .* it has rounds 0, 1"):
        folder.restore_checkpoint(5)

    (folder.path / CHECKPOINT_DIR / round_file(1)).write_bytes(b"torn")
    assert folder.intact_checkpoint() == 0
