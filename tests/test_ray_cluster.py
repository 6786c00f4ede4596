"""``fedmech run`` and ``fedmech sweep`` on a Ray cluster of two nodes: a head and a second
raylet joined to it (``ray start --head``, ``ray start --address``, one CPU each), both on
this machine, each test on its own cluster (own temp dir, free ports).

- a run trains clients on both nodes (the records' ``ray_node``) and ends bitwise as the
  same seed on a private Ray; a sweep's two cells at once share the cluster;
- the second node (its raylet and actors) is killed (SIGKILL) once round 1 is recorded:
  with ``on_client_failure: fail`` the run fails naming the node, leaves nothing running,
  and ``--resume`` on the healthy cluster left (the head) ends with the uninterrupted
  run's weights; with ``continue`` the run records the lost node and trains every later
  round on the head.

The same run on a private Ray, made once per session, is the reference of both. Each test
takes 1 to 2.5 min on 2 cores under a load of 12.
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

from conftest import REPO, assert_gone, launch_processes_of, once_per_session
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.artifacts.liveness import process_alive
from fedmech_flwr.tools.local_flower import QUIET_ENV, free_port
from fedmech_flwr.tools.processes import stop_processes, descendants

pytestmark = pytest.mark.integration
RAY = Path(sys.executable).parent / "ray"
RUN = ("federation.num_rounds=3", "train.epochs=10")
"""The smoke experiment (3 clients), a round long enough to lose a node in."""
TIMEOUT_S = 300


class Cluster:
    """A Ray head and worker nodes started here with ``ray start --block`` (one CPU each)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.temp = Path(tempfile.mkdtemp(prefix="fm-ray-"))  # short: Ray's socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.head = self.add("--head", "--port", str(self.port), "--include-dashboard", "false", "--no-monitor",
                             "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()))

    def add(self, *flags: str) -> subprocess.Popen:
        """Start a node (a worker joined to the head unless ``flags`` say ``--head``)."""
        log = self.folder / f"ray-node-{len(self.nodes)}.log"
        with open(log, "w") as out:
            node = subprocess.Popen(
                [str(RAY), "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                 "--temp-dir", str(self.temp), "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port",
                 "0", "--dashboard-agent-listen-port", str(free_port()),
                 *(flags or ("--address", self.address))],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_ENV}, start_new_session=True)
        self.nodes.append(node)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        return node

    @staticmethod
    def raylet(node: subprocess.Popen) -> tuple[int, str]:
        """The pid and Ray node id of ``node``'s raylet."""
        for pid in descendants(node.pid):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if args[0].endswith(b"/raylet"):
                return pid, next(a.split(b"=")[1].decode() for a in args if a.startswith(b"--node_id="))
        raise AssertionError(f"no raylet under {node.pid}")

    def actors(self) -> list[int]:
        """The live client actors on this cluster's nodes (a run's; none between runs)."""
        return [pid for node in self.nodes if node.poll() is None for pid in descendants(node.pid)
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ClientAppActor")]

    def stop(self) -> None:
        stop_processes(*self.nodes, grace_s=5)  # not `ray stop`: that stops every Ray instance on the machine
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def private_run(tmp_path_factory) -> Path:
    """The run folder of the same run on a private Ray, made once per session."""
    def make(out: Path) -> None:
        proc = run(out)
        try:
            finished(proc, out)
        finally:
            if proc.poll() is None:
                stop_processes(proc)

    folder = once_per_session(tmp_path_factory, "ray-cluster-private-run", make)
    (run_dir,) = list((folder / "runs").iterdir())
    return run_dir


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.add()
        yield cluster
    finally:
        cluster.stop()


def fedmech(out: Path, *args: str) -> subprocess.Popen:
    """``fedmech ARGS`` in the background, its output in out/fedmech.log."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fedmech.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "fedmech_flwr.tools.cli", *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, text=True)


def run(out: Path, *overrides: str) -> subprocess.Popen:
    sets = [arg for item in (*RUN, *overrides) for arg in ("--set", item)]
    return fedmech(out, "run", "experiments/smoke.yaml", "--out", str(out / "runs"), *sets)


def finished(proc: subprocess.Popen, out: Path, code: int = 0) -> Path:
    """The run folder of ``proc``, once it exited with ``code``."""
    assert proc.wait(timeout=TIMEOUT_S) == code, (out / "fedmech.log").read_text()[-4000:]
    (run_dir,) = list((out / "runs").iterdir())
    return run_dir


def client_nodes(run_dir: Path) -> dict[tuple[int, int], str]:
    return {(r["round"], r["partition_id"]): r["ray_node"] for r in read_records(run_dir, "client")}


def weights(run_dir: Path) -> bytes:
    return (run_dir / "model_final.safetensors").read_bytes()


def test_a_run_trains_on_both_nodes_and_ends_as_on_a_private_ray(private_run, cluster, tmp_path):
    run_dir = finished(run(tmp_path, f"simulation.ray_address={cluster.address}"), tmp_path)
    output = (tmp_path / "fedmech.log").read_text()
    assert f"simulation uses the existing Ray cluster at {cluster.address}" in output and f"completed: {run_dir}" in output
    assert [r["round"] for r in read_records(run_dir, "eval")] == [0, 1, 2, 3]
    nodes = client_nodes(run_dir)
    assert set(nodes.values()) == {cluster.raylet(node)[1] for node in cluster.nodes}, "clients did not use both nodes"
    assert weights(run_dir) == weights(private_run)
    assert not cluster.actors(), "the run's actors outlived it"


def test_a_sweep_runs_two_cells_at_once_on_the_cluster(cluster, tmp_path):
    """Each run makes an actor for every CPU of the cluster; two at once each train on
    those of theirs that Ray placed, a run with none waits for the other to end."""
    (tmp_path / "sweep.yaml").write_text(json.dumps({
        "base": str(REPO / "experiments" / "smoke.yaml"), "name": "cluster", "seeds": [0, 1],
        "set": {"simulation.ray_address": cluster.address, "federation.num_rounds": 1}}))
    sweep = fedmech(tmp_path, "sweep", str(tmp_path / "sweep.yaml"), "--out", str(tmp_path), "--parallel", "2")
    assert sweep.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "fedmech.log").read_text()[-4000:]
    ids = {cluster.raylet(node)[1] for node in cluster.nodes}
    for cell in ("base_s0", "base_s1"):
        assert set(client_nodes(tmp_path / "cluster" / "runs" / cell).values()) <= ids
    assert not cluster.actors()


def round_done(out: Path, proc: subprocess.Popen, server_round: int) -> None:
    """Wait until the run of ``proc`` has recorded ``server_round``'s global model."""
    deadline = time.monotonic() + TIMEOUT_S
    while not [r for m in (out / "runs").glob("*/metrics.jsonl") for r in read_records(m.parent, "eval")
               if r["round"] == server_round]:
        assert proc.poll() is None and time.monotonic() < deadline, (out / "fedmech.log").read_text()[-4000:]
        time.sleep(0.05)


def kill_worker(cluster: Cluster) -> str:
    """SIGKILL the worker node's raylet and every process under it (its client actors: a
    raylet's actors serve calls for seconds after it died), as when the machine dies;
    return that node's id once they are all gone."""
    worker = cluster.nodes[1]
    node_id = cluster.raylet(worker)[1]
    node_processes = [worker.pid, *descendants(worker.pid)]
    for pid in node_processes:
        os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=60)
    assert_gone(node_processes, 30, "processes of the lost node are still alive")
    return node_id


def test_a_lost_node_fails_the_run_naming_it_and_resume_ends_as_uninterrupted(private_run, cluster, tmp_path):
    out = tmp_path / "lost"
    lost = run(out, f"simulation.ray_address={cluster.address}")
    round_done(out, lost, 1)
    launched = launch_processes_of(lost.pid)
    node_id = kill_worker(cluster)  # in round 2 (or 3, should round 2 end first)
    run_dir = finished(lost, out, code=1)
    output = (out / "fedmech.log").read_text()
    assert f"RayNodeLost: Ray node {node_id} " in output and "on_client_failure is 'fail'" in output
    status = read_status(run_dir)
    assert status["status"] == "failed" and node_id in status["error"] and status["resumable"]
    assert {r["ray_node"] for r in read_records(run_dir, "failure")} == {node_id}
    assert not [p for p in launched if process_alive(p)] and not cluster.actors(), "the failed run left processes"

    resumed = fedmech(out, "run", "--resume", str(run_dir))  # on the head, all the cluster has left
    assert resumed.wait(timeout=TIMEOUT_S) == 0, (out / "fedmech.log").read_text()[-4000:]
    assert read_status(run_dir)["status"] == "completed"
    assert weights(run_dir) == weights(private_run)


def test_a_lost_node_with_continue_goes_on_with_the_other_node(cluster, tmp_path):
    out = tmp_path / "lost"
    proc = run(out, f"simulation.ray_address={cluster.address}", "federation.on_client_failure=continue",
               "federation.num_rounds=4")
    round_done(out, proc, 1)
    node_id = kill_worker(cluster)
    run_dir = finished(proc, out)
    failures = read_records(run_dir, "failure")
    (lost_in,) = {r["round"] for r in failures}  # 2, or 3 when round 2 ended before the kill took effect
    assert lost_in < 4 and {r["ray_node"] for r in failures} == {node_id}
    assert all(f"RayNodeLost: Ray node {node_id} " in r["reason"] for r in failures)
    later = [r for r in read_records(run_dir, "client") if r["round"] > lost_in]
    assert {r["ray_node"] for r in later} == {cluster.raylet(cluster.head)[1]} and len(later) == 3 * (4 - lost_in)
    assert not cluster.actors()
