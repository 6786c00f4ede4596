"""The self-describing run folder: what a run wrote, under names defined once here.

::

    <run>/config.yaml              resolved experiment config
    <run>/environment.json         versions, git hash, seed, host, device
    <run>/partitions.json          per-client sample counts and label histograms
    <run>/metrics.jsonl            append-only records, one JSON object per line
    <run>/checkpoints/round_NNN.safetensors   global model after round N
    <run>/model_final.safetensors  the final global model
    <run>/diagnostics/<name>/round_NNN.safetensors   arrays a diagnostic returned
    <run>/plots/*.png              drawn from the files above only (``fedmech plot``)
    <run>/status.json              running | completed | failed (+ error)
    <run>/logs/*.log               SuperLink and SuperNode logs (``fedmech deploy-local`` only)

Every ``metrics.jsonl`` record has ``kind`` and ``round``; kinds are ``eval`` (global
model on the test set), ``client`` (one client's training in one round), ``failure``
(a client that failed and the policy applied) and ``diagnostic`` (one diagnostic's
metrics in one round, under ``name``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedmech_flwr.arrays import NamedArrays, save_arrays
from fedmech_flwr.hooks import ClientUpdate, DiagnosticResult

CONFIG_FILE = "config.yaml"
ENVIRONMENT_FILE = "environment.json"
PARTITIONS_FILE = "partitions.json"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
FINAL_MODEL_FILE = "model_final.safetensors"
CHECKPOINT_DIR = "checkpoints"
DIAGNOSTICS_DIR = "diagnostics"
PLOTS_DIR = "plots"
LOGS_DIR = "logs"

APP_DIR = Path(__file__).resolve().parents[1]


def round_file(server_round: int) -> str:
    return f"round_{server_round:03d}.safetensors"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _git_revision(path: Path) -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def read_records(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records (optionally one kind), in the order written.

    A last line cut off by a crash is skipped, not an error.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a fedmech run folder?")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records


class RunFolder:
    """Writes one run's artifacts; every write goes through this class."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, out_root: str | Path, name: str, run_dir: str | Path | None = None) -> RunFolder:
        """Make a new run folder: ``run_dir`` if given (must be new or empty), else
        ``<out_root>/<name>-<UTC timestamp>``."""
        if run_dir:
            path = Path(run_dir).expanduser().resolve()
            if path.exists() and any(path.iterdir()):
                raise FileExistsError(f"run folder {path} already exists and is not empty; pick a new one")
        else:
            stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
            path = Path(out_root).expanduser().resolve() / f"{name}-{stamp}"
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path)
        folder.set_status("running")
        return folder

    def write_config(self, plain_config: dict[str, Any]) -> None:
        _write_atomic(self.path / CONFIG_FILE, yaml.safe_dump(plain_config, sort_keys=False))

    def write_environment(self, seed: int, device: str, run_config: dict[str, Any]) -> None:
        import torch

        env = {
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "seed": seed,
            "device": device,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "host": socket.gethostname(),
            "packages": {p: _version(p) for p in ("fedmech-flwr", "flwr", "torch", "torchvision", "numpy", "ray")},
            "git": _git_revision(APP_DIR),
            "flower_run_config": run_config,
        }
        _write_atomic(self.path / ENVIRONMENT_FILE, json.dumps(env, indent=2))

    def write_partitions(self, parts: list[np.ndarray], histograms: np.ndarray, class_names: list[str], audit_size: int) -> None:
        clients = [
            {"partition_id": i, "num_samples": int(len(p)), "label_histogram": histograms[i].astype(int).tolist()}
            for i, p in enumerate(parts)
        ]
        payload = {"num_clients": len(parts), "class_names": class_names, "audit_samples": audit_size, "clients": clients}
        _write_atomic(self.path / PARTITIONS_FILE, json.dumps(payload, indent=1))

    def append(self, record: dict[str, Any]) -> None:
        """Append one record to metrics.jsonl and flush it to disk."""
        with open(self.path / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(record, sort_keys=True, allow_nan=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def client(self, server_round: int, update: ClientUpdate) -> None:
        metrics = {k: v for k, v in update.metrics.items() if k != "num-examples"}
        self.append({"kind": "client", "round": server_round, "partition_id": update.partition_id,
                     "num_examples": update.num_examples, **metrics})

    def failure(self, server_round: int, partition_id: int, reason: str, policy: str) -> None:
        self.append({"kind": "failure", "round": server_round, "partition_id": partition_id,
                     "reason": reason, "policy": policy})

    def diagnostic(self, server_round: int, name: str, result: DiagnosticResult, seconds: float) -> None:
        if result.arrays:
            save_arrays(self.path / DIAGNOSTICS_DIR / name / round_file(server_round), result.arrays)
        self.append({"kind": "diagnostic", "round": server_round, "name": name, "seconds": seconds, **result.metrics})

    def eval(self, server_round: int, metrics: dict[str, Any]) -> None:
        self.append({"kind": "eval", "round": server_round, **metrics})

    def checkpoint(self, server_round: int, arrays: NamedArrays) -> None:
        save_arrays(self.path / CHECKPOINT_DIR / round_file(server_round), arrays, {"round": str(server_round)})

    def final_model(self, arrays: NamedArrays) -> None:
        save_arrays(self.path / FINAL_MODEL_FILE, arrays)

    def set_status(self, status: str, error: str | None = None) -> None:
        payload = {"status": status, "updated_at": dt.datetime.now(dt.timezone.utc).isoformat()}
        if error:
            payload["error"] = error
        _write_atomic(self.path / STATUS_FILE, json.dumps(payload, indent=1))


def read_status(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else {"status": "missing"}
