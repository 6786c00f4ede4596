"""Deployment: ``fedmech deploy-local`` (SuperLink + SuperNodes, TLS, SuperNode auth) and the
node-side data path.

The integration test here stops a deployment under SuperNode auth, its credentials made by
``deploy-local``, with SIGTERM, which must leave nothing behind (about 20 s). A deployment
that turns away an unregistered node is in ``test_deploy_node_data.py``, simulation on a
Ray cluster in ``test_ray_cluster.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, smoke_config
from fedmech_flwr.app.client_app import node_dataset
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.spec.config import experiment_from_json
from fedmech_flwr.tools.deployment import MAKE_CERTS, Credentials
from fedmech_flwr.tools.local_flower import free_port
from fedmech_flwr.tools.processes import stop_processes

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
def test_deploy_local_stops_everything_on_sigterm(tmp_path):
    """With ``--auth`` and no ``--certs``: deploy-local makes the credentials itself."""
    port = free_port()
    deploy = fedmech("deploy-local", tmp_path, "--auth", "--port", str(port))
    try:
        wait_for_line(tmp_path / "fedmech.log", "2 SuperNodes online", deploy)
        assert "(TLS, SuperNode auth)" in (tmp_path / "fedmech.log").read_text()
        assert len(processes_mentioning(f"127.0.0.1:{port}")) >= 3  # SuperLink and two SuperNodes
        deploy.send_signal(signal.SIGTERM)
        assert deploy.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if deploy.poll() is None:
            stop_processes(deploy)
    assert not processes_mentioning(f"127.0.0.1:{port}"), "SIGTERM left Flower processes behind"
