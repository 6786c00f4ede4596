"""Own-data nodes on the real Deployment Engine (``fedmech deploy-local --node-data``).

Two runs, about 2.5 and 2 min on 2 busy cores (every ClientApp message starts a process):
nodes on files holding exactly the simulation's shards must end bitwise as ``fedmech run``
does; a mixed federation under TLS and SuperNode auth (2 shard nodes, 1 own-data node, 1
node with bad data, refused, and an unregistered fifth node turned away) must complete and
say in partitions.json which node is which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_deploy import SMALL_RUN, fedmech, processes_mentioning

from conftest import smoke_config, without_measured
from fedmech_flwr.app.node_data import write_node_data
from fedmech_flwr.artifacts.folder import FINAL_MODEL_FILE, LOGS_DIR, read_records, read_status
from fedmech_flwr.learning.arrays import load_arrays
from fedmech_flwr.tools.deployment import MAKE_CERTS
from fedmech_flwr.tools.local_flower import QUIET_ENV, free_port
from fedmech_flwr.tools.processes import stop_processes

pytestmark = pytest.mark.integration
VENV_BIN = Path(sys.executable).parent


def finished(proc, out) -> None:
    try:
        assert proc.wait(timeout=480) == 0, (out / "fedmech.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_deploy_local_on_the_shards_files_ends_bitwise_as_fedmech_run(tmp_path):
    nodes = tmp_path / "nodes"
    write_node_data(smoke_config(list(SMALL_RUN)), nodes)
    simulated = fedmech("run", tmp_path / "sim")
    deployed = fedmech("deploy-local", tmp_path / "deploy", "--node-data", str(nodes))
    finished(simulated, tmp_path / "sim")
    finished(deployed, tmp_path / "deploy")
    assert "2 SuperNodes online" in (tmp_path / "deploy" / "fedmech.log").read_text()
    (sim,) = list((tmp_path / "sim" / "runs").iterdir())
    (dep,) = list((tmp_path / "deploy" / "runs").iterdir())
    ref, new = load_arrays(sim / FINAL_MODEL_FILE), load_arrays(dep / FINAL_MODEL_FILE)
    assert all(np.array_equal(ref[k], new[k]) for k in ref)
    assert without_measured(read_records(dep)) == without_measured(read_records(sim))
    sim_parts, dep_parts = (json.loads((run / "partitions.json").read_text()) for run in (sim, dep))
    assert [c.pop("source") for c in sim_parts["clients"]] == ["shard", "shard"]
    assert [(c.pop("source"), c.pop("node")) for c in dep_parts["clients"]] == [
        ("node-provided", "node_000"), ("node-provided", "node_001")]
    assert dep_parts == sim_parts


def test_mixed_federation_with_a_refused_node_completes_under_auth(tmp_path):
    """4 SuperNodes under TLS and SuperNode auth, from certificates made by the shipped
    script: 2 on shards, 1 on its own data, 1 whose data is refused; and a fifth node whose
    key was never registered, turned away by the SuperLink. The run completes, says in
    partitions.json which node is which, and leaves no Flower process behind."""
    overrides = ("federation.num_clients=4", "federation.num_rounds=1", "federation.on_client_failure=continue")
    nodes = tmp_path / "nodes"
    write_node_data(smoke_config(list(overrides)), nodes, partition_ids=[2])
    np.savez(nodes / "node_999.npz", x=np.zeros((20, 28, 28), np.float32), y=np.arange(20) % 4)
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(MAKE_CERTS), str(certs), "5"], check=True, capture_output=True)  # node_4: never registered
    port = free_port()
    deploy = fedmech("deploy-local", tmp_path, "--auth", "--certs", str(certs), "--port", str(port), "--node-data",
                     str(nodes), overrides=overrides)
    intruder_log = tmp_path / "intruder.log"
    with open(intruder_log, "w") as log:
        intruder = subprocess.Popen(
            [str(VENV_BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
             "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
             "--auth-supernode-private-key", str(certs / "node_4"), "--node-config", "partition-id=0 num-partitions=4"],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV, "FLWR_HOME": str(tmp_path / "intruder-home"),
                 "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"},  # it starts flower-superexec by name
            start_new_session=True,
        )
    try:
        intruder.wait(timeout=180)
        finished(deploy, tmp_path)
    finally:
        if intruder.poll() is None:
            stop_processes(intruder)
    output = (tmp_path / "fedmech.log").read_text()
    assert "4 SuperNodes online" in output and "(TLS, SuperNode auth; 2 with their own data)" in output
    (run,) = list((tmp_path / "runs").iterdir())
    assert f"completed: {run}" in output and read_status(run)["status"] == "completed"
    parts = json.loads((run / "partitions.json").read_text())["clients"]
    assert [(c["partition_id"], c["source"], c.get("node")) for c in parts] == [
        (0, "shard", None), (1, "shard", None), (2, "node-provided", "node_002")]
    assert sorted(r["partition_id"] for r in read_records(run, "client")) == [0, 1, 2]
    (failure,) = read_records(run, "failure")
    assert failure["round"] == 0 and "NodeDataError: node 'node_999'" in failure["reason"]
    assert "images are 28x28 pixels, expected 12x12" in failure["reason"]
    # the refused node's console says why
    assert "node 'node_999' refuses to take part" in (run / LOGS_DIR / "supernode_3.log").read_text()
    # The unregistered node was turned away, and both sides say so.
    assert intruder.returncode != 0
    assert "Failed to activate SuperNode" in intruder_log.read_text()
    assert "No SuperNode found with the given public key" in (run / LOGS_DIR / "superlink.log").read_text()
    assert sorted(p.name for p in (run / LOGS_DIR).iterdir()) == [
        "client_failures.log", "flwr_run.log", "superlink.log", *(f"supernode_{i}.log" for i in range(4))]
    assert not processes_mentioning(f"127.0.0.1:{port}"), "deploy-local left Flower processes behind"
