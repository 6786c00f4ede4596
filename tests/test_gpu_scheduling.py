"""GPU scheduling without a GPU; what is refused where there is no CUDA, or no GPU share;
benchmarks/gpu_check.sh's refusal on a machine without a GPU.

Ray counts GPUs as resources: a node started with ``--num-gpus 2`` on a CPU-only machine
hands out GPU ids and shares of them as a real one does. So the scheduling of
``simulation.gpus_per_client`` is tested here (how many clients at once, which GPU each
holds), not the CUDA work; docs/how-to/gpu.md says what has run on a GPU and what has not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMOKE, smoke_config
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.spec.experiment import check_simulated
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, _engine, main
from fedmech_flwr.tools.local_flower import QUIET_ENV, free_port
from fedmech_flwr.tools.processes import stop_processes
from test_deploy import processes_mentioning, wait_for_line

VENV_BIN = Path(sys.executable).parent
GPU_CHECK = REPO / "benchmarks" / "gpu_check.sh"
HOLD_S = 4
"""How long each client of round 2 holds its actor: long enough for all of them to be busy at once."""
FLOWER_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""Flower 1.42's simulation hands messages to its actors from a ``ThreadPoolExecutor()``
(vce_api.py), whose default size is this: no more clients run at once, whatever the actors."""
PROBE = f'''"""Plain training that reports what Ray gave the actor it runs in."""
import os
import time

import ray

from fedmech_flwr.api.client import CLIENTS, FedMechClient
from fedmech_flwr.learning.training import resolve_device


@CLIENTS.register("gpu_probe")
class GpuProbe(FedMechClient):
    def fit(self, parameters, config):
        start = time.time()
        if int(config["server-round"]) == 2:  # every actor warm: they all start at once
            time.sleep({HOLD_S})
        weights, num_examples, metrics = super().fit(parameters, config)
        gpu_ids, free = ray.get_gpu_ids(), ray.available_resources()
        return weights, num_examples, {{
            **metrics, "probe-start": start, "probe-end": time.time(), "probe-pid": os.getpid(),
            "probe-gpu-id": int(gpu_ids[0]) if len(gpu_ids) == 1 else -1,
            "probe-cuda-visible": int(os.environ.get("CUDA_VISIBLE_DEVICES") or -1),
            "probe-gpu-share": ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0),
            "probe-gpus-free": free.get("GPU", 0.0), "probe-cpus-free": free.get("CPU", 0.0),
            "probe-auto-is-cuda": int(resolve_device("auto").type == "cuda"),
            "probe-trained-on-cpu": int(next(self.model.parameters()).is_cpu),
        }}
'''


# --- device: cuda where torch sees no CUDA ------------------------------------------------

def _refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err  # one line, and nothing started
    return err


@pytest.mark.parametrize("command", ["validate", "run"])
def test_device_cuda_without_cuda_is_refused_before_anything_starts(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = ["--out", str(tmp_path / "runs")] if command == "run" else []
    err = _refusal(capsys, [command, str(SMOKE), *out, "--set", "device=cuda"])
    assert err.startswith("error: device is 'cuda' but torch sees no CUDA device on this machine")
    assert "set device: auto" in err and err.rstrip().endswith(f"in {SMOKE}: device")
    assert not (tmp_path / "runs").exists()


def test_device_cuda_is_refused_even_when_the_clients_go_to_a_ray_cluster(monkeypatch, capsys):
    """The server evaluates and diagnoses on ``device`` on this machine, wherever the clients run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refusal(capsys, ["validate", str(SMOKE), "--set", "device=cuda",
                            "--set", "simulation.ray_address=head:6379"])
    assert "even when simulation.ray_address sends the clients to a cluster" in err


def test_device_auto_without_cuda_validates(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["validate", str(SMOKE), "--set", "device=auto"]) == 0
    assert capsys.readouterr().out.startswith("OK: ")


# --- device: cuda for simulated clients that declare no GPU share -------------------------

def test_device_cuda_with_no_gpu_share_is_refused_by_run_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Ray empties CUDA_VISIBLE_DEVICES in an actor that asks for no GPU: every client would fail."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = _refusal(capsys, ["run", str(SMOKE), "--out", str(tmp_path / "runs"), "--set", "device=cuda"])
    assert err.startswith("error: device is 'cuda' but simulation.gpus_per_client is 0: Ray hides the GPUs")
    assert err.rstrip().endswith(f"in {SMOKE}: simulation.gpus_per_client")
    assert not (tmp_path / "runs").exists()


def test_device_cuda_with_no_gpu_share_is_refused_in_every_sweep_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sweep = tmp_path / "gpu.yaml"
    sweep.write_text(f"base: {SMOKE}\nseeds: [0]\npresets: {{gpu: {{set: {{device: cuda}}}}}}\n")
    err = _refusal(capsys, ["sweep", str(sweep), "--preset", "gpu", "--dry-run"])
    assert f"in {sweep} cell base_s0: simulation.gpus_per_client" in err


def test_a_gpu_share_on_a_private_ray_without_a_gpu_is_refused_by_run(tmp_path, monkeypatch, capsys):
    """Before anything starts: else Flower makes no actor, and the run fails after Ray's start
    ("ActorPool is empty"). A Ray cluster (``ray_address``) may have GPUs this machine lacks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refusal(capsys, ["run", str(SMOKE), "--out", str(tmp_path / "runs"),
                            "--set", "simulation.gpus_per_client=0.25"])
    assert err.startswith("error: simulation.gpus_per_client is 0.25 but this machine has no GPU")
    assert err.rstrip().endswith(f"in {SMOKE}: simulation.gpus_per_client")
    assert not (tmp_path / "runs").exists()
    check_simulated(smoke_config(["simulation.gpus_per_client=0.25", "simulation.ray_address=head:6379"]), "")


def test_a_gpu_share_makes_device_cuda_a_simulation_and_the_start_line_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = smoke_config(["device=cuda", "simulation.gpus_per_client=0.25"])
    check_simulated(cfg, "x.yaml: ")
    assert _engine(cfg) == "simulation on a private Ray, 1 CPU(s) and 0.25 GPU per client"


# --- benchmarks/gpu_check.sh ---------------------------------------------------------------

def test_gpu_check_script_parses():
    done = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_gpu_check_refuses_without_a_gpu_before_any_step():
    """No GPU for torch (none here; hidden on a machine with one): exit 2, one line saying why
    and where to run it, before any step starts."""
    done = subprocess.run(["bash", str(GPU_CHECK)], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sees no CUDA device" in errors[0], done.stderr
    assert "run it on a machine with an NVIDIA GPU" in errors[0]
    assert "[1/" not in done.stdout  # no step started


# --- a Ray node declaring 2 GPUs -----------------------------------------------------------

@pytest.mark.integration
def test_a_half_gpu_per_client_runs_at_most_four_clients_on_two_declared_gpus(tmp_path):
    """6 clients, all sampled, on a Ray head declaring 12 CPUs and 2 GPUs (none real), with
    ``gpus_per_client: 0.5`` and ``device: cpu``. Flower makes one actor per client slot,
    ``min(12 / 1 CPU, 2 / 0.5 GPU)`` = 4, so the GPUs are the cap, below Flower's thread
    pool (``FLOWER_THREADS``: 6 on 2 cores). Each client reports, from inside its actor,
    Ray's own accounting: the GPU id and the share the actor holds, and the cluster's free
    GPUs and CPUs. ``device: auto`` there resolves to the CPU (Ray sets
    CUDA_VISIBLE_DEVICES; torch still sees no CUDA)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "gpu_probe.py").write_text(PROBE)
    env = {**os.environ, **QUIET_ENV, "RAY_prestart_worker_first_driver": "0",  # no idle workers per CPU
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    ray_dir, port = Path(tempfile.mkdtemp(prefix="fm-ray-")), free_port()  # short: Ray's socket paths
    with open(tmp_path / "ray-head.log", "w") as log:
        head = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", "12", "--num-gpus", "2", "--temp-dir", str(ray_dir), "--include-dashboard", "false",
             "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0",
             "--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port()),
             "--dashboard-agent-listen-port", str(free_port()), "--no-monitor"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    sets = ["federation.num_clients=6", "federation.num_rounds=2", "data.partition={name: iid}", "diagnostics=[]",
            "plugins=[gpu_probe]", "client={name: gpu_probe}", "device=cpu", "simulation.gpus_per_client=0.5",
            f"simulation.ray_address=127.0.0.1:{port}"]
    try:
        wait_for_line(tmp_path / "ray-head.log", "Ray runtime started", head)
        done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(SMOKE), "--out",
                               str(tmp_path / "runs"), *(x for s in sets for x in ("--set", s))],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    finally:
        stop_processes(head, grace_s=5)  # not `ray stop`: that stops every Ray instance on the machine
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"simulation on the Ray cluster at 127.0.0.1:{port}, 1 CPU(s) and 0.5 GPU per client" in done.stdout
    assert not processes_mentioning(str(ray_dir)), "the Ray head was not stopped"
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert read_status(run_dir)["status"] == "completed"
    clients = read_records(run_dir, "client")
    assert sorted((r["round"], r["partition_id"]) for r in clients) == [(n, p) for n in (1, 2) for p in range(6)]

    # Ray's accounting while round 2 trains: 4 of the 12 CPUs and both GPUs are held, i.e. 4
    # actors of (1 CPU, 0.5 GPU): the GPUs, not the CPUs, capped the pool.
    second = [r for r in clients if r["round"] == 2]
    assert {(r["probe_gpus_free"], r["probe_cpus_free"]) for r in second} == {(0.0, 8.0)}
    # Each actor that ran a client holds half of GPU 0 or GPU 1, at most two per GPU.
    actors = {r["probe_pid"]: r["probe_gpu_id"] for r in clients}
    assert {r["probe_gpu_share"] for r in clients} == {0.5}
    assert len(actors) <= 4 and set(actors.values()) <= {0, 1} and max(Counter(actors.values()).values()) <= 2
    # An actor runs one client at a time: at most 4 of the 6 train at once (fewer where
    # Flower's thread pool is smaller), and round 2, every actor warm, reaches that cap.
    spans = [(r["probe_start"], r["probe_end"]) for r in clients]
    peak = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert peak == min(4, FLOWER_THREADS), sorted(spans)
    # device: cpu trains on the CPU; device: auto there would too, though Ray shows each
    # actor its GPU in CUDA_VISIBLE_DEVICES.
    assert {(r["probe_trained_on_cpu"], r["probe_auto_is_cuda"]) for r in clients} == {(1, 0)}
    assert all(r["probe_cuda_visible"] == r["probe_gpu_id"] for r in clients)
