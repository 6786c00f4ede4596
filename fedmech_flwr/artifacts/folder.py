"""The self-describing run folder: what a run wrote, under names defined once here.

::

    <run>/config.yaml              resolved experiment config
    <run>/environment.json         versions, git hash, seed, host, device
    <run>/partitions.json          per-client sample counts, label histograms and data source
    <run>/metrics.jsonl            append-only records, one JSON object per line
    <run>/outputs.json             what the records hold, as the run's plug-ins declared it (labels,
                                   units, curves, ...), each flagged value's flag, every round,
                                   and the strategy's parameter defaults: readers show it
                                   without importing a plug-in
    <run>/state.safetensors        resume point: the last completed round (every round)
    <run>/checkpoints/round_NNN.safetensors   global model after round N (every N rounds)
    <run>/checkpoints/state/round_NNN.safetensors   the rest of round N's resume point (strategy
                                   and diagnostic state): ``fedmech run --resume RUN --from-checkpoint N``
    <run>/model_final.safetensors  the final global model
    <run>/diagnostics/<name>/round_NNN.safetensors   arrays a diagnostic returned
    <run>/diagnoses.jsonl          records of diagnostics rerun on saved rounds (``fedmech diagnose``),
                                   named ``NAME@LABEL``; the run itself never writes it
    <run>/plots/*.png              drawn from the files above only (``fedmech plot``)
    <run>/plots/drawn.json         which plots each plug-in drew (``core``, ``strategy``, a diagnostic's name)
    <run>/status.json              running | completed | failed | interrupted (+ error, resumable, and
                                   the writer: pid, host and process start)
    <run>/run.lock                 the ``fedmech`` process running it (pid, host, start, since), while it runs
    <run>/.status-reserve          space kept for the status until the run completes (a full disk)
    <run>/logs/*.log               SuperLink and SuperNode logs (``fedmech deploy-local`` only)
    <run>/logs/client_failures.log the full error text (a traceback) of each failed client, appended

Every ``metrics.jsonl`` record has ``kind`` and ``round``; kinds are ``eval`` (global
model on the test set), ``client`` (one client's training in one round), ``failure``
(a client that failed, a one-line reason, the policy applied and, for an error reply,
``details``: the log holding its whole text; a node refused before the first round is
recorded in round 0 with ``node``, its node id) and ``diagnostic`` (one diagnostic's
metrics in one round, under ``name``).

Surviving a kill: records are appended as whole lines and fsynced (a reader skips a torn
last line with a warning); every other file but the logs is replaced atomically.
``state.safetensors`` is the commit point of a round: written last, after the round's
eval record, so a killed run resumes (``RunFolder.resume``) from the last round it
holds, and ``rewind`` drops what later rounds had written.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedmech_flwr.artifacts.liveness import live_holder, this_process, writer_alive, writer_gone
from fedmech_flwr.contracts.hooks import ClientUpdate, DiagnosticResult
from fedmech_flwr.contracts.outputs import Outputs, outputs_from_plain, outputs_to_plain, record_key
from fedmech_flwr.datasets.data import repo_root
from fedmech_flwr.foundation.errors import BadFileError, RunFolderError
from fedmech_flwr.foundation.files import TEMPORARY_GLOB, write_text_atomic
from fedmech_flwr.foundation.safe_text import strip_colours
from fedmech_flwr.learning.arrays import NamedArrays, load_arrays, save_arrays

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
ENVIRONMENT_FILE = "environment.json"
PARTITIONS_FILE = "partitions.json"
METRICS_FILE = "metrics.jsonl"
DIAGNOSES_FILE = "diagnoses.jsonl"
OUTPUTS_FILE = "outputs.json"
STATUS_FILE = "status.json"
RESERVE_FILE = ".status-reserve"
"""Space kept for the status while a run is under way: on a full disk it is given up so
that the run can still say how it ended."""
RESERVE_BYTES = 64 * 1024
LOCK_FILE = "run.lock"
FINAL_MODEL_FILE = "model_final.safetensors"
STATE_FILE = "state.safetensors"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_STATE_DIR = f"{CHECKPOINT_DIR}/state"
DIAGNOSTICS_DIR = "diagnostics"
PLOTS_DIR = "plots"
LOGS_DIR = "logs"
CLIENT_FAILURES_LOG = "client_failures.log"

APP_DIR = Path(__file__).resolve().parents[2]


def round_file(server_round: int) -> str:
    return f"round_{server_round:03d}.safetensors"


ROUND_FILE_GLOB = "round_*.safetensors"
STATE_ROUND = "round"
"""In ``state.safetensors``: the round it holds (a 0-d integer array)."""
STATE_MODEL = "model/"
"""In ``state.safetensors``: prefix of the global model's arrays; the rest is the
round protocol's state (strategy and diagnostics, see ``RoundProtocol.state``)."""


def round_of(path: Path) -> int:
    """The round of a ``round_NNN.safetensors`` file."""
    return int(path.stem.split("_")[1])


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


def _record_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line (``read_records`` reads them back)."""
    return json.dumps(record, sort_keys=True, allow_nan=True) + "\n"


def _is_record(value: Any) -> bool:
    """Whether a parsed metrics.jsonl line has what every record has (``_record_line``)."""
    return (isinstance(value, dict) and isinstance(value.get("kind"), str)
            and isinstance(value.get("round"), int) and not isinstance(value["round"], bool))



def read_diagnoses(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records ``fedmech diagnose`` wrote beside the run's own (none: empty)."""
    return read_records(run_dir, file=DIAGNOSES_FILE) if (Path(run_dir) / DIAGNOSES_FILE).is_file() else []


def read_records(run_dir: str | Path, kind: str | None = None, file: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records (or another file's: ``DIAGNOSES_FILE``), optionally
    of one kind, in the order written.

    A last line cut off by a kill (not JSON) is skipped with a warning; a bad line before
    it, or any line that is JSON but not a record (an object with ``kind`` and ``round``),
    is a ``BadFileError``: the file was edited or damaged, not killed mid-write.
    """
    path = Path(run_dir) / file
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a fedmech run folder?")
    lines = path.read_bytes().splitlines()
    records = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except ValueError as err:  # not UTF-8 (a multi-byte character cut off), or not JSON
            if number < len(lines):
                raise BadFileError(
                    f"{path}, line {number}: expected one JSON record per line, got {raw[:80]!r} "
                    f"({' '.join(str(err).split())}); the file was damaged: restore it or delete that line"
                ) from err
            log.warning("%s: skipping the torn last line %d (%r): the run was killed while writing it",
                        path, number, raw[:80])
            continue
        if not _is_record(record):
            raise BadFileError(
                f"{path}, line {number}: expected a record (a JSON object with a string 'kind' and an "
                f"integer 'round'), got {line[:80]!r}; the file was damaged: restore it or delete that line"
            )
        if kind is None or record["kind"] == kind:
            records.append(record)
    return records


def read_outputs(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, Any] | None] | None:
    """The declarations a run recorded (``RunFolder.write_outputs``), as data
    (``outputs.outputs_from_plain`` makes them ``Outputs``), its flags by metric and round,
    and its strategy's parameter defaults (None from a run before they were recorded);
    None for a folder from before runs recorded any of them."""
    path = Path(run_dir) / OUTPUTS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes())
        declarations, flags = doc["declarations"], doc["flags"]
        if not isinstance(declarations, dict) or not isinstance(flags, dict):
            raise TypeError("expected two objects, declarations and flags")
        outputs_from_plain(declarations, lambda key, record: None)  # refuse what cannot be read, here
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadFileError(f"{path} is not the declarations a run records ({type(err).__name__}: {err}); the file "
                           "was damaged: delete it to read the run with the built-in plug-ins' declarations") from None
    defaults = doc.get("strategy_defaults")
    return declarations, flags, defaults if isinstance(defaults, dict) else None


def records_end(records: list[dict[str, Any]], config: dict[str, Any]) -> int:
    """The last round ``r`` such that every round from 0 to ``r`` holds its records: its
    eval record, and a record of every diagnostic the saved ``config`` (plain, as in
    config.yaml) makes due in it; -1 when round 0 lacks its eval record. A completed run
    holds them all (``num_rounds``); a torn or cut metrics.jsonl ends earlier."""
    evals = {r["round"] for r in records if r["kind"] == "eval"}
    diagnosed = {(r.get("name"), r["round"]) for r in records if r["kind"] == "diagnostic"}
    specs = [s for s in config.get("diagnostics") or [] if isinstance(s, dict)]
    num_rounds = (config.get("federation") or {}).get("num_rounds", 0)
    for server_round in range(num_rounds + 1):
        due = [s["name"] for s in specs if server_round > 0 and _due(s, server_round)]
        if server_round not in evals or any((name, server_round) not in diagnosed for name in due):
            return server_round - 1
    return num_rounds


def _due(spec: dict[str, Any], server_round: int) -> bool:
    """``config.DiagnosticSpec.due`` of a diagnostic as config.yaml holds it."""
    if spec.get("rounds") is not None:
        return server_round in spec["rounds"]
    return server_round % (spec.get("every") or 1) == 0




SWEEP_MANIFEST_FILE = "sweep.json"
"""In a sweep folder: the manifest ``fedmech sweep`` writes (its cells, their status and wall time)."""
SWEEP_LOCK_FILE = "sweep.lock"
"""In a sweep folder: the ``fedmech sweep`` process running it (pid, host, since), while it runs."""


@dataclass
class ResumePoint:
    """What ``state.safetensors`` holds: the last completed round and what it left."""

    last_round: int
    global_arrays: NamedArrays
    protocol_state: NamedArrays
    """Strategy and diagnostic state (``RoundProtocol.state``)."""


class RunFolder:
    """Writes one run's artifacts; every write goes through this class."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recent: list[dict[str, Any]] = []
        """The records this process wrote of the round it wrote last (the console's round line)."""

    @classmethod
    def create(cls, out_root: str | Path, name: str, run_dir: str | Path | None = None) -> RunFolder:
        """Make a new run folder: ``run_dir`` if given (new, or empty but for the
        ``run.lock`` of the ``fedmech run`` that chose it), else
        ``<out_root>/<name>-<UTC timestamp>``."""
        if run_dir:
            path = Path(run_dir).expanduser().resolve()
            if path.exists() and any(p.name != LOCK_FILE for p in path.iterdir()):
                raise FileExistsError(f"run folder {path} already exists and is not empty; pick a new one")
        else:
            stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
            path = Path(out_root).expanduser().resolve() / f"{name}-{stamp}"
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path)
        folder.reserve()
        folder.set_status("running")
        return folder

    @classmethod
    def resume(cls, run_dir: str | Path) -> RunFolder:
        """Reopen the run folder of a killed or failed run to continue it.

        Refuses a folder that is not a run folder, a completed run, and a run whose
        writer is still alive on this host.
        """
        path = Path(run_dir).expanduser().resolve()
        missing = [name for name in (CONFIG_FILE, STATUS_FILE) if not (path / name).is_file()]
        if missing:
            raise RunFolderError(
                f"{path} is not a fedmech run folder (no {' or '.join(missing)}); "
                "pass a folder that `fedmech run` created"
            )
        status = read_status(path)
        folder = cls(path)
        if status["status"] == "completed" and folder.missing_rounds() is None:
            raise RunFolderError(f"{path} holds a completed run: nothing to resume; start a new run instead")
        if writer_alive(status):
            raise RunFolderError(
                f"{path} is still being written by process {status['pid']} on this host; "
                "stop that run first (or wait for it), then resume"
            )
        folder.reserve()
        return folder

    def missing_rounds(self) -> tuple[int, int] | None:
        """``(N, M)`` where the records end at round N of the M the config asks for
        (``records_end``), else None (all there, or no config or records to tell)."""
        config = yaml.safe_load((self.path / CONFIG_FILE).read_text()) if (self.path / CONFIG_FILE).is_file() else None
        num_rounds = ((config or {}).get("federation") or {}).get("num_rounds") if isinstance(config, dict) else None
        if not isinstance(num_rounds, int) or not (self.path / METRICS_FILE).is_file():
            return None
        end = records_end(read_records(self.path), config)
        return (end, num_rounds) if end < num_rounds else None

    def resume_point(self) -> ResumePoint | None:
        """Where a resume continues: the resume point (``load_state``), unless the records
        end before it (a torn metrics.jsonl, records lost after the round was committed);
        then the latest intact numbered checkpoint of a round the records hold, or None
        (from the start), so that the rounds whose records are missing run again."""
        point = self.load_state()
        missing = self.missing_rounds()
        if point is None or missing is None or point.last_round <= missing[0]:
            return point
        end, earlier = missing[0], None
        for server_round in reversed([r for r in self.checkpoint_rounds() if r <= end]):
            try:
                earlier = self.checkpoint_point(server_round)
                break
            except BadFileError:
                continue
        log.warning("%s: records end at round %d but the resume point is round %d; resuming from %s", self.path,
                    end, point.last_round, f"the checkpoint of round {earlier.last_round}" if earlier else "the start")
        return earlier

    def write_config(self, plain_config: dict[str, Any]) -> None:
        write_text_atomic(self.path / CONFIG_FILE, yaml.safe_dump(plain_config, sort_keys=False))

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
            "git": _git_revision(repo_root()),
            "flower_run_config": run_config,
        }
        write_text_atomic(self.path / ENVIRONMENT_FILE, json.dumps(env, indent=2))

    def write_partitions(self, clients: list[dict[str, Any]], class_names: list[str], audit_size: int) -> None:
        """partitions.json: one entry per client (``partition_id``,
        ``num_samples``, ``label_histogram``, ``source``: ``shard`` or ``node-provided``,
        and an own-data node's ``node`` name)."""
        payload = {"num_clients": len(clients), "class_names": class_names, "audit_samples": audit_size, "clients": clients}
        write_text_atomic(self.path / PARTITIONS_FILE, json.dumps(payload, indent=1))

    def append(self, record: dict[str, Any]) -> None:
        """Append one record to metrics.jsonl and flush it to disk."""
        if self.recent and self.recent[-1]["round"] != record["round"]:
            self.recent = []
        self.recent.append(record)
        with open(self.path / METRICS_FILE, "a") as fh:
            fh.write(_record_line(record))
            fh.flush()
            os.fsync(fh.fileno())

    def client(self, server_round: int, update: ClientUpdate) -> None:
        metrics = {record_key(k): v for k, v in update.metrics.items() if k != "num-examples"}
        self.append({"kind": "client", "round": server_round, "partition_id": update.partition_id,
                     "num_examples": update.num_examples, **metrics})

    def failure(self, server_round: int, partition_id: int | None, reason: str, policy: str, details: str = "",
                node: int | None = None, ray_node: str | None = None) -> None:
        """Record a failed client with a one-line ``reason``; ``details`` (the client's
        whole error text, a Ray traceback say) goes to ``logs/client_failures.log``, which
        the record names. A node refused before the first round has no partition id
        (``partition_id`` None): round 0, with its ``node`` id. A client lost with its Ray
        node has that node's id (``ray_node``, as in the client records)."""
        record = {"kind": "failure", "round": server_round, "partition_id": partition_id,
                  "reason": reason, "policy": policy}
        if node is not None:
            record["node"] = node
        if ray_node is not None:
            record["ray_node"] = ray_node
        if details:
            log_file = self.path / LOGS_DIR / CLIENT_FAILURES_LOG
            log_file.parent.mkdir(exist_ok=True)
            stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            with open(log_file, "a") as fh:
                who = f"client {partition_id}" if partition_id is not None else f"node {node}"
                fh.write(f"--- round {server_round}, {who}, {stamp}: {reason}\n"
                         f"{strip_colours(details).rstrip()}\n")
            record["details"] = f"{LOGS_DIR}/{CLIENT_FAILURES_LOG}"
        self.append(record)

    def diagnostic(self, server_round: int, name: str, result: DiagnosticResult, seconds: float) -> None:
        if result.arrays:
            save_arrays(self.path / DIAGNOSTICS_DIR / name / round_file(server_round), result.arrays)
        metrics = {record_key(k): v for k, v in result.metrics.items()}
        self.append({"kind": "diagnostic", "round": server_round, "name": name, "seconds": seconds, **metrics})

    def strategy(self, server_round: int, metrics: dict[str, Any]) -> None:
        """The aggregate's MetricRecord (the strategy's own per-round figures, e.g.
        ``aggregate_seconds`` or what matched_avg moved)."""
        self.append({"kind": "strategy", "round": server_round, **{record_key(k): v for k, v in metrics.items()}})

    def write_outputs(self, outputs: dict[str, Outputs], flags: dict[str, dict[str, str]],
                      strategy_defaults: dict[str, Any]) -> None:
        """Record the declarations of what the records hold, the flags of their flagged
        values (``outputs.recorded_flags``) and the strategy's parameter defaults (which a
        report compares the parameters with, without importing the strategy), replacing
        the last."""
        write_text_atomic(self.path / OUTPUTS_FILE, json.dumps(
            {"declarations": outputs_to_plain(outputs), "flags": flags, "strategy_defaults": strategy_defaults},
            indent=1, default=str))

    def eval(self, server_round: int, metrics: dict[str, Any]) -> None:
        self.append({"kind": "eval", "round": server_round, **metrics})

    def checkpoint(self, server_round: int, arrays: NamedArrays, protocol_state: NamedArrays) -> None:
        """The global model after ``server_round``, and beside it the rest of that round's
        resume point, so a run can resume from here too (``restore_checkpoint``)."""
        save_arrays(self.path / CHECKPOINT_DIR / round_file(server_round), arrays, {"round": str(server_round)})
        save_arrays(self.path / CHECKPOINT_STATE_DIR / round_file(server_round),
                    {**protocol_state, STATE_ROUND: np.asarray(server_round)})

    def checkpoint_models(self) -> list[int]:
        """The rounds whose global model has a numbered checkpoint."""
        return sorted(round_of(p) for p in (self.path / CHECKPOINT_DIR).glob(ROUND_FILE_GLOB))

    def checkpoint_rounds(self) -> list[int]:
        """The rounds whose numbered checkpoint has its saved state beside it."""
        states = self.path / CHECKPOINT_STATE_DIR
        models = self.path / CHECKPOINT_DIR
        return sorted(round_of(p) for p in states.glob(ROUND_FILE_GLOB) if (models / p.name).is_file())

    def checkpoint_point(self, server_round: int) -> ResumePoint:
        """The resume point that numbered checkpoint ``server_round`` and its state make
        (a damaged file is a ``BadFileError`` naming it)."""
        model = load_arrays(self.path / CHECKPOINT_DIR / round_file(server_round))
        state = load_arrays(self.path / CHECKPOINT_STATE_DIR / round_file(server_round), expected=[STATE_ROUND])
        return ResumePoint(server_round, model, {k: v for k, v in state.items() if k != STATE_ROUND})

    def intact_checkpoint(self) -> int | None:
        """The latest round whose numbered checkpoint and state can be read, or None."""
        for server_round in reversed(self.checkpoint_rounds()):
            try:
                self.checkpoint_point(server_round)
            except BadFileError:
                continue
            return server_round
        return None

    def restore_checkpoint(self, server_round: int) -> None:
        """Make numbered checkpoint ``server_round`` the resume point, replacing
        ``state.safetensors`` (damaged, or of a later round): a resume then rewinds the
        folder to that round and runs the later rounds again."""
        rounds = self.checkpoint_rounds()
        if server_round not in rounds:
            have = f"rounds {', '.join(map(str, rounds))}" if rounds else "none"
            raise RunFolderError(
                f"{self.path / CHECKPOINT_DIR} holds no checkpoint of round {server_round} with its state "
                f"(checkpoints/state/{round_file(server_round)}); it has {have}: pick one of those"
            )
        self.save_state(self.checkpoint_point(server_round))

    def final_model(self, arrays: NamedArrays) -> None:
        save_arrays(self.path / FINAL_MODEL_FILE, arrays)

    def save_state(self, point: ResumePoint) -> None:
        """Commit a round: replace the resume point (written last in every round)."""
        arrays = {f"{STATE_MODEL}{k}": v for k, v in point.global_arrays.items()}
        save_arrays(self.path / STATE_FILE, {**arrays, **point.protocol_state, STATE_ROUND: np.asarray(point.last_round)})

    def load_state(self) -> ResumePoint | None:
        """The resume point, or None when the run was killed before its first one."""
        path = self.path / STATE_FILE
        if not path.is_file():
            return None
        arrays = load_arrays(path, expected=[STATE_ROUND])
        model = {k[len(STATE_MODEL):]: v for k, v in arrays.items() if k.startswith(STATE_MODEL)}
        rest = {k: v for k, v in arrays.items() if not k.startswith(STATE_MODEL) and k != STATE_ROUND}
        return ResumePoint(int(arrays[STATE_ROUND]), model, rest)

    def rewind(self, last_round: int | None) -> None:
        """Forget what rounds after ``last_round`` wrote (all rounds if None): their
        metrics records (and a torn last line), round files, temporaries, and the final
        model (written again when the run completes)."""
        keep = -1 if last_round is None else last_round
        metrics = self.path / METRICS_FILE
        if metrics.is_file():
            kept = [_record_line(r) for r in read_records(self.path) if r["round"] <= keep]
            write_text_atomic(metrics, "".join(kept))
        later = [p for p in self.path.glob(f"**/{ROUND_FILE_GLOB}") if round_of(p) > keep]
        for path in [*later, *self.path.glob(FINAL_MODEL_FILE), *self.path.glob(f"**/{TEMPORARY_GLOB}")]:
            path.unlink()
        log.info("rewound %s to round %s: removed %d later file(s)", self.path, last_round, len(later))

    def hand_over(self) -> bool:
        """Leave the run's end to the ``fedmech`` process that holds ``run.lock``, which
        keeps the logs and writes the page, then completes the run (``tools.finish``):
        status "running" under that process's name, so that readers see a live writer
        until it is done, and an interrupted run if it dies first. False where no live
        process holds the lock (a user's own ``flwr run``): the caller completes the run."""
        holder = live_holder(self.path / LOCK_FILE)
        if holder is None:
            return False
        self.set_status("running", writer={k: holder[k] for k in ("pid", "host", "start")}, finishing=True)
        return True

    def set_status(self, status: str, error: str | None = None, resumable: bool | None = None,
                   writer: dict[str, Any] | None = None, finishing: bool = False) -> None:
        """Replace status.json; it names this process (or ``writer``, the process that
        takes the run over: ``hand_over``, with ``finishing``), so a resume can tell a
        live writer. A failure or an interruption says why in one line (``error``) and
        whether resuming can help."""
        payload = {"status": status, "updated_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                   **(writer or this_process())}
        if finishing:
            payload["finishing"] = True
        if error:
            payload["error"] = error
        if resumable is not None:
            payload["resumable"] = resumable
        text, reserve = json.dumps(payload, indent=1), self.path / RESERVE_FILE
        try:
            write_text_atomic(self.path / STATUS_FILE, text)
        except OSError as err:
            if err.errno != errno.ENOSPC or not reserve.is_file():
                raise
            reserve.unlink()
            write_text_atomic(self.path / STATUS_FILE, text)
        if status == "completed":
            reserve.unlink(missing_ok=True)

    def record_end(self, status: str, reason: str, resumable: bool) -> None:
        """``set_status`` for a run that ends badly (failed, interrupted), with its one-line
        ``reason``; where even that cannot be written (a disk full beyond the reserve), the
        log says so and readers see a dead writer, which reads as interrupted."""
        try:
            self.set_status(status, reason, resumable=resumable)
        except OSError as err:
            log.error("could not record in %s that the run %s (%s): %s", self.path, status, err.strerror or err,
                      reason)

    def reserve(self) -> None:
        """Keep ``RESERVE_BYTES`` for the status (``set_status`` gives them up on a full
        disk); where even that cannot be written, the run goes on without."""
        try:
            (self.path / RESERVE_FILE).write_bytes(bytes(RESERVE_BYTES))
        except OSError as err:
            (self.path / RESERVE_FILE).unlink(missing_ok=True)
            log.warning("could not keep space for the status in %s: %s", self.path, err.strerror or err)



def settle_status(run_dir: str | Path, flower_status: str) -> dict[str, Any]:
    """The run folder's status once Flower has ended its run: a "running" whose writer is
    gone from this host (its ServerApp died before it could say how it ended) becomes
    "failed" with that reason, so no status outlives its writer."""
    status = read_status(run_dir)
    if writer_gone(status):
        RunFolder(Path(run_dir)).record_end(
            "failed", f"the ServerApp ended without recording an outcome (Flower: {flower_status}); see its log", True)
        status = read_status(run_dir)
    return status


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """status.json (``{"status": "missing"}`` when there is none); a damaged one is a
    ``BadFileError`` naming it."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return {"status": "missing"}
    try:
        status = json.loads(path.read_bytes())
    except ValueError as err:
        raise BadFileError(f"{path} is not JSON ({err}); the file was damaged: restore it, or write "
                           '{"status": "failed"} into it to resume the run') from None
    if not isinstance(status, dict) or not isinstance(status.get("status"), str):
        raise BadFileError(f"{path}: expected an object with a string 'status', got {str(status)[:80]}; the file "
                           'was damaged: restore it, or write {"status": "failed"} into it to resume the run')
    return status
