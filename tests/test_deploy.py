"""Deployment and scale-out: ``fedmech deploy-local`` (SuperLink + SuperNodes, TLS, SuperNode
auth), an existing Ray cluster for simulation, and the node-side data path.

The integration tests start real Flower and Ray processes: one TLS + auth deployment that
must complete while an unregistered node is refused (about 2 min on 2 busy cores: every
ClientApp message starts a process), one deployment stopped with SIGTERM that must leave
nothing behind (about 20 s), and one simulation on a Ray head started here (about 1 min).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, smoke_config
from fedmech_flwr.app.client_app import node_dataset
from fedmech_flwr.config import experiment_from_json
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.run_folder import LOGS_DIR, read_records, read_status
from fedmech_flwr.tools.launch import MAKE_CERTS, QUIET_ENV, Credentials, _free_port, _stop

VENV_BIN = Path(sys.executable).parent
SMALL_RUN = ("federation.num_clients=2", "federation.num_rounds=2")


def fedmech(command: str, out: Path, *options: str, overrides: tuple[str, ...] = SMALL_RUN) -> subprocess.Popen:
    """``fedmech COMMAND experiments/smoke.yaml`` in the background, output to out/fedmech.log."""
    cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", command, "experiments/smoke.yaml", "--out", str(out / "runs"), *options]
    for item in overrides:
        cmd += ["--set", item]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fedmech.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)


def processes_mentioning(text: str) -> list[str]:
    """Command lines of the live processes whose arguments contain ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and str(os.getpid()) != cmdline.parent.name:
            found.append(args)
    return found


def wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return
        assert proc.poll() is None, f"exited with {proc.returncode} before printing {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not printed within {timeout:.0f}s:\n{path.read_text()[-3000:]}")


# --- fast ------------------------------------------------------------------------------

def test_node_data_root_replaces_the_dataset_root():
    plain = smoke_config().to_plain()
    plain["data"]["dataset"] = {"name": "fashion_mnist", "root": "/server/fmnist"}
    cfg = experiment_from_json(json.dumps(plain))  # as a node gets it: the server's data path is not checked here
    assert node_dataset(cfg, {"partition-id": 0}) is cfg
    moved = node_dataset(cfg, {"partition-id": 0, "data-root": "/device/fmnist"})
    assert moved.data.dataset.params.root == "/device/fmnist"
    assert cfg.data.dataset.params.root == "/server/fmnist"  # the shared config is untouched
    with pytest.raises(ConfigError, match="dataset 'synthetic' has no root to replace; drop data-root"):
        node_dataset(smoke_config(), {"data-root": "/device/data"})


def test_missing_credentials_name_the_files_and_the_script(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        Credentials(tmp_path).check(2, auth=True)
    assert str(tmp_path / "ca.crt") in str(err.value) and str(tmp_path / "node_1.pub") in str(err.value)
    assert f"{MAKE_CERTS} {tmp_path} 2" in str(err.value)


# --- Deployment Engine -----------------------------------------------------------------

@pytest.mark.integration
def test_deploy_local_with_tls_and_auth_refuses_an_unregistered_node(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(MAKE_CERTS), str(certs), "3"], check=True, capture_output=True)  # node_2: never registered
    port = _free_port()
    deploy = fedmech("deploy-local", tmp_path, "--auth", "--certs", str(certs), "--port", str(port))
    intruder_log = tmp_path / "intruder.log"
    with open(intruder_log, "w") as log:
        intruder = subprocess.Popen(
            [str(VENV_BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
             "--superlink", f"127.0.0.1:{port}", "--port", str(_free_port()),
             "--auth-supernode-private-key", str(certs / "node_2"), "--node-config", "partition-id=0 num-partitions=2"],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV, "FLWR_HOME": str(tmp_path / "intruder-home"),
                 "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"},  # it starts flower-superexec by name
            start_new_session=True,
        )
    try:
        intruder.wait(timeout=180)
        assert deploy.wait(timeout=420) == 0, (tmp_path / "fedmech.log").read_text()[-4000:]
    finally:
        for proc in (intruder, deploy):
            if proc.poll() is None:
                _stop(proc)
    output = (tmp_path / "fedmech.log").read_text()
    assert "2 SuperNodes online" in output and "(TLS, SuperNode auth)" in output
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert f"completed: {run_dir}" in output
    assert read_status(run_dir)["status"] == "completed"
    clients = read_records(run_dir, "client")
    assert sorted((r["round"], r["partition_id"]) for r in clients) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # The unregistered node was turned away, and both sides say so.
    assert intruder.returncode != 0
    assert "Failed to activate SuperNode" in intruder_log.read_text()
    assert "No SuperNode found with the given public key" in (run_dir / LOGS_DIR / "superlink.log").read_text()
    assert sorted(p.name for p in (run_dir / LOGS_DIR).iterdir()) == ["flwr_run.log", "superlink.log", "supernode_0.log",
                                                                  "supernode_1.log"]
    assert not processes_mentioning(f"127.0.0.1:{port}"), "deploy-local left Flower processes behind"


@pytest.mark.integration
def test_deploy_local_stops_everything_on_sigterm(tmp_path):
    port = _free_port()
    deploy = fedmech("deploy-local", tmp_path, "--port", str(port))
    try:
        wait_for_line(tmp_path / "fedmech.log", "2 SuperNodes online", deploy)
        assert len(processes_mentioning(f"127.0.0.1:{port}")) >= 3  # SuperLink and two SuperNodes
        deploy.send_signal(signal.SIGTERM)
        assert deploy.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if deploy.poll() is None:
            _stop(deploy)
    assert not processes_mentioning(f"127.0.0.1:{port}"), "SIGTERM left Flower processes behind"


# --- an existing Ray cluster -----------------------------------------------------------

@pytest.mark.integration
def test_simulation_runs_on_an_existing_ray_cluster(tmp_path):
    """A Ray head started here (like ``ray start --head`` on a cluster's first machine);
    the run must use it: its driver shows up in the head's session logs."""
    ray_dir, port = Path(tempfile.mkdtemp(prefix="fm-ray-")), _free_port()  # short: Ray's socket paths
    with open(tmp_path / "ray-head.log", "w") as log:
        head = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
             "--temp-dir", str(ray_dir), "--include-dashboard", "false", "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_ENV}, start_new_session=True,
        )
    try:
        wait_for_line(tmp_path / "ray-head.log", "Ray runtime started", head)
        run = fedmech("run", tmp_path, overrides=(*SMALL_RUN, f"simulation.ray_address=127.0.0.1:{port}"))
        assert run.wait(timeout=420) == 0, (tmp_path / "fedmech.log").read_text()[-4000:]
        drivers = list(ray_dir.glob("session_latest/logs/python-core-driver-*.log"))
    finally:
        _stop(head, grace_s=5)  # not `ray stop`: that stops every Ray instance on the machine
        shutil.rmtree(ray_dir, ignore_errors=True)
    output = (tmp_path / "fedmech.log").read_text()
    assert f"simulation uses the existing Ray cluster at 127.0.0.1:{port}" in output
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert f"completed: {run_dir}" in output
    assert [r["round"] for r in read_records(run_dir, "eval")] == [0, 1, 2]
    assert len(drivers) == 1, "the simulation did not connect to the Ray head started by the test"
    assert not processes_mentioning(str(ray_dir)), "the Ray head was not stopped"
