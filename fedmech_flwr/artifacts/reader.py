"""The one reader of run and sweep folders: what ``fedmech status``, ``fedmech report``,
``fedmech export`` and ``fedmech plot`` know of a folder, read from its files alone.

Read-only, and only what is committed: whole lines of metrics.jsonl and of diagnoses.jsonl
(the records ``fedmech diagnose`` reran on saved rounds; ``read_records`` skips a torn last
one), status.json, sweep.json and sweep.lock (each replaced or made atomically).
Whether the process a status.json or a lock names still runs is ``liveness.writer_of``'s
one rule: on this host its process is checked; on another host (a folder copied from
there, or on a disk two machines share) it is named and not checked: running there as far
as the files say, never "killed" by guess.

A run's ``status``:

- ``completed``, ``failed``: what status.json says (a failure with its error);
- ``running``: status.json says so and its writer is alive on this host, or runs on
  another host (``writer.where`` says "not checked from here"); a cell of a running sweep
  that has no status.json yet (starting);
- ``interrupted``: status.json says so (Ctrl-C, SIGTERM or SIGHUP stopped its ``fedmech``
  process), or says running but its writer is gone from this host; a sweep cell its
  sweep stopped or whose sweep was killed; a run status.json calls completed whose
  records end before its last round ("completed, but records end at round N of M":
  ``artifacts.folder.records_end``), which ``--resume`` completes;
- ``pending``: a sweep cell not started yet; ``unknown``: a run folder with a config and
  no status.json (killed or failed at its start); ``never started``: a folder that holds
  the ``run.lock`` of a ``fedmech`` process now gone (and perhaps its logs), nothing of
  a run (while that process lives: running, "starting").

A sweep's manifest has the last word on a cell that did not complete (``failed``: rerun
only with ``--retry-failed``; ``interrupted``: resumed by the same ``fedmech sweep``
command), unless the cell's own writer is alive on this host.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.folder import (
    CONFIG_FILE, ENVIRONMENT_FILE, LOCK_FILE, METRICS_FILE, PARTITIONS_FILE, STATUS_FILE, SWEEP_LOCK_FILE,
    SWEEP_MANIFEST_FILE, read_diagnoses, read_outputs, read_records, read_status, records_end,
)
from fedmech_flwr.artifacts.liveness import Writer, lock_writer, writer_of
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.outputs import (
    metrics_of,
    outputs_from_plain,
    outputs_to_plain,
    reading,
    records_of,
    registered_outputs,
)
from fedmech_flwr.foundation.errors import BadFileError, ConfigError, RunFolderError, brief, shape
from fedmech_flwr.foundation.yaml_text import read_yaml_file

NOT_A_FOLDER = ("is neither a run folder (status.json, config.yaml and metrics.jsonl, made by `fedmech run`) nor a "
                "sweep folder (sweep.json and runs/, made by `fedmech sweep`)")
def sweep_killed(command: str | None) -> str:
    """A cell's reason when its sweep was killed: how to continue it, with the exact
    command sweep.json keeps (older sweeps, which lack it: the same command again)."""
    again = f"`{command}`" if command else "the same `fedmech sweep` command again"
    return f"its sweep was killed; run {again} to continue it"


@dataclass
class FolderRun:
    """One run folder as its files say, or a sweep cell that has none yet."""

    name: str
    path: Path
    status: str = "pending"
    """completed | failed | running | interrupted | pending | unknown | never started (see
    the module's docstring)."""
    error: str | None = None
    """Why it failed or was interrupted, in one line."""
    writer: Writer | None = None
    """The process status.json names, while it says running (None: a cell starting)."""
    resumable: bool = True
    """False when status.json says a resume would fail the same way."""
    seed: int | None = None
    config: dict[str, Any] | None = None
    group: str | None = None
    """The sweep's group name (None for run folders given directly)."""
    axes: dict[str, str] = field(default_factory=dict)
    seconds: float | None = None
    """Wall time: the sweep's count, else from environment.json to status.json."""
    commit: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    class_names: list[str] | None = None
    outputs: tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, Any] | None] | None = None
    """What its records hold, as its plug-ins declared it when it ran, its flagged values'
    flags and its strategy's parameter defaults (``artifacts.folder.read_outputs``); None
    for a folder from before runs recorded them."""
    num_rounds: int | None = None
    eta: float | None = None
    """Seconds left, for a running run whose pace is known."""

    @property
    def last_round(self) -> int | None:
        """The last round with an eval record; None before the first."""
        evals = [r["round"] for r in self.records if r["kind"] == "eval"]
        return evals[-1] if evals else None

    @property
    def ok(self) -> bool:
        return self.status in ("completed", "running")

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def note(self) -> str | None:
        """What follows the status where a view names it: why it failed or was
        interrupted, or where it runs (``on HOST (pid P), not checked from here``)."""
        if self.status == "running":
            return self.writer.where if self.writer else "starting"
        return self.error

    def records_of(self, source: str) -> list[dict[str, Any]]:
        return records_of(self.records, source)


@dataclass
class SweepFolder:
    """A sweep folder: its manifest, its cells as runs, and where it stands."""

    path: Path
    manifest: dict[str, Any]
    runs: list[FolderRun]
    writer: Writer | None
    """The process sweep.lock names (None: no lock)."""
    state: str = ""
    """completed | running | failed (nothing left to run but failed cells) | interrupted"""
    detail: str = ""
    eta: float | None = None
    """Seconds left, for a running sweep whose pace is known."""
    median: float | None = None
    """The median wall time of a completed cell."""

    @property
    def name(self) -> str:
        return self.manifest.get("name", self.path.name)

    @property
    def cells(self) -> dict[str, FolderRun]:
        return {run.name: run for run in self.runs}

    def count(self, state: str) -> int:
        return sum(run.status == state for run in self.runs)

    @property
    def ok(self) -> bool:
        return self.state in ("completed", "running") and not self.count("failed") + self.count("interrupted")

    @property
    def running(self) -> bool:
        return self.state == "running"


def seconds_per_round(evals: list[dict[str, Any]]) -> float | None:
    """A run's pace: the mean time between consecutive eval records since the last restart
    of ``elapsed_seconds`` (a resume starts it again from ~0). The first of those records
    is the start (round 0's time is start-up, no round's), so it takes one finished round
    after it; None before (and in older folders, whose records lack the key)."""
    timed = [(r["round"], r["elapsed_seconds"]) for r in evals if isinstance(r.get("elapsed_seconds"), (int, float))]
    restarts = [i for i in range(1, len(timed)) if timed[i][1] < timed[i - 1][1]]
    timed = timed[restarts[-1]:] if restarts else timed
    if len(timed) < 2 or timed[-1][0] <= timed[0][0]:
        return None
    (first, t0), (last, t1) = timed[0], timed[-1]
    return (t1 - t0) / (last - first)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _num_rounds(config: dict[str, Any] | None, path: Path) -> int | None:
    rounds = ((config or {}).get("federation") or {}).get("num_rounds")
    if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool)):
        raise BadFileError(f"{path}: expected an integer federation.num_rounds, got {brief(rounds)}; the file was "
                           "damaged")
    return rounds


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ``{}`` when it is gone."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as err:
        raise BadFileError(f"{path} is not JSON ({err}); the file was damaged") from None
    if not isinstance(doc, dict):
        raise BadFileError(f"{path}: expected a JSON object, got {shape(doc)}; the file was damaged")
    return doc


def _reason(own: str | None, sweep: str | None) -> str | None:
    """A failed cell's reason: the sweep's (which names the cell's log) where it holds the
    run's own; else the run's own, the sweep's beside it."""
    if own and sweep and own != sweep:
        return sweep if own in sweep else f"{own} (sweep: {sweep})"
    return own or sweep


def _folder_state(run: FolderRun, status: dict[str, Any]) -> tuple[str, str | None]:
    """The state and reason status.json gives, with the writer's liveness applied. A run
    whose rounds are done and whose end this very process is writing (``finishing``: its
    page, say) reads as completed: it is, once that page is on disk."""
    state = status["status"]
    if state == "running":
        run.writer = writer_of(status)
        if run.writer and run.writer.state == "gone":
            return "interrupted", ("its process ended without recording an outcome; continue it with "
                                   f"`fedmech run --resume {run.path}`")
        if status.get("finishing") and run.writer and run.writer.state == "alive" and run.writer.pid == os.getpid():
            return "completed", None
        return "running", None
    if state in ("failed", "interrupted"):
        run.resumable = status.get("resumable") is not False
        return state, status.get("error") or "no reason recorded"
    if state != "completed":
        raise BadFileError(f"{run.path / STATUS_FILE}: status {state!r} is none of running, completed, failed, "
                           'interrupted; the file was damaged: restore it, or write {"status": "failed"} into it')
    return state, None


def _open(run: FolderRun, claimed: str | None = None, sweep_running: bool = False, command: str | None = None) -> None:
    """Fill ``run`` from its folder: status (``claimed``: what a sweep's manifest says of
    it, ``sweep_running``: whether its sweep runs, ``command``: what continues it), config,
    records, commit, wall time."""
    path = run.path
    if (path / CONFIG_FILE).is_file():
        run.config = read_yaml_file(path / CONFIG_FILE) or {}
        if not isinstance(run.config, dict):
            raise BadFileError(f"{path / CONFIG_FILE}: expected the resolved experiment config (a mapping), got "
                               f"{shape(run.config)}; the file was damaged")
    run.num_rounds = _num_rounds(run.config, path / CONFIG_FILE)
    sweep_error, run.error = run.error, None
    if claimed == "running" and not sweep_running:
        claimed, sweep_error = "interrupted", sweep_killed(command)
    status = read_status(path)
    if status["status"] == "missing":  # a cell not started, or killed before its run wrote a status
        run.status = claimed if claimed in ("failed", "interrupted", "running") else "pending"
        run.error = (sweep_error or "no reason recorded") if run.status == "failed" else sweep_error
    else:
        run.status, own = _folder_state(run, status)
        alive_here = run.writer is not None and run.writer.state == "alive"
        if run.status == "completed" or alive_here or claimed not in ("failed", "interrupted"):
            run.error = own
        elif claimed == "failed":
            run.status, run.error = "failed", _reason(own, sweep_error)
        else:
            run.status, run.error = "interrupted", sweep_error or own
    env = _read_json(path / ENVIRONMENT_FILE)
    git = env.get("git") or {}
    if commit := git.get("commit"):
        run.commit = commit[:12] + (" (dirty)" if git.get("dirty") else "")
    if run.seconds is None and env.get("started_at") and run.status in ("completed", "failed") \
            and status.get("updated_at"):
        run.seconds = (dt.datetime.fromisoformat(status["updated_at"])
                       - dt.datetime.fromisoformat(env["started_at"])).total_seconds()
    if (path / METRICS_FILE).is_file():
        run.records = read_records(path) + read_diagnoses(path)  # the run's own, then fedmech diagnose's
        parts = path / PARTITIONS_FILE
        run.class_names = json.loads(parts.read_text())["class_names"] if parts.is_file() else None
        run.outputs = read_outputs(path)
    if run.status == "completed" and run.num_rounds is not None and \
            (end := records_end(run.records, run.config or {})) < run.num_rounds:
        run.status, run.error = "interrupted", (
            f"completed, but records end at round {max(end, 0)} of {run.num_rounds} ({METRICS_FILE} lost the rest); "
            f"`fedmech run --resume {path}` runs the missing rounds again")
    if run.status == "running" and run.num_rounds is not None and run.last_round is not None:
        pace = seconds_per_round([r for r in run.records if r["kind"] == "eval"])
        run.eta = pace * (run.num_rounds - run.last_round) if pace is not None else None


def read_run(path: str | Path) -> FolderRun:
    """A run folder given directly; one that its run left before saving its config
    (killed or failed at start) has its status alone."""
    path = Path(path)
    run = FolderRun(path.name, path)
    _open(run)
    if run.config is None and run.status == "pending":
        raise ConfigError(f"{path} has no {CONFIG_FILE}: pass run folders that `fedmech run` made, or a sweep folder")
    run.config = run.config or {}
    run.seed = run.config.get("seed")
    if run.status == "pending":
        run.status = "unknown"  # no status.json
    return run


def _sweep_eta(runs: list[FolderRun], median: float | None, parallel: int | None) -> float | None:
    """The cells left times the median cell, over the cells run at once (the sweep's
    --parallel; in an older sweep.json, which lacks it, the cells running now), plus the
    longest time a running cell has left (one of unknown pace: the median)."""
    running = [c for c in runs if c.status == "running"]
    left = [c.eta if c.eta is not None else median for c in running]
    waiting = sum(c.status in ("pending", "interrupted") for c in runs)
    if None in left or (waiting and median is None):
        return None
    at_once = parallel or max(1, len(running))
    return (waiting * median / at_once if waiting else 0.0) + max(left, default=0.0)


def read_sweep(folder: str | Path) -> SweepFolder:
    """A sweep folder: its manifest, its cells as runs (``run_dir`` is relative to the
    folder, and must stay inside it; a cell without a run folder is pending, or as its
    manifest says), whether it
    runs (its sweep.lock's writer alive here, or on another host) and its ETA."""
    folder = Path(folder)
    path = folder / SWEEP_MANIFEST_FILE
    manifest = _read_json(path)
    cells = manifest.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              and isinstance(c.get("run_dir"), str)
                                              and isinstance(c.get("axes", {}), dict) for c in cells):
        raise BadFileError(f"{path}: expected the manifest `fedmech sweep` writes (a list of cells, each with a name "
                           "and a run_dir); the file was damaged: run the sweep again, or pass its run folders instead")
    writer = lock_writer(folder / SWEEP_LOCK_FILE)
    running = writer is not None and writer.state in ("alive", "elsewhere")
    runs = []
    for cell in cells:
        if not (folder / cell["run_dir"]).resolve().is_relative_to(folder.resolve()):
            raise BadFileError(f"{path}: cell {brief(cell['name'])} has run_dir {brief(cell['run_dir'])}, which "
                               "leads out of the sweep folder; a sweep's runs are inside it (runs/CELL): the file "
                               "was damaged or edited, so it is not read")
        run = FolderRun(cell["name"], folder / cell["run_dir"], seed=cell.get("seed"), config=cell.get("config"),
                        group=cell.get("group", cell["name"]),
                        axes={k: _text(v) for k, v in cell.get("axes", {}).items()},
                        error=cell.get("error"), seconds=cell.get("seconds"))
        _open(run, cell.get("status"), running, manifest.get("command"))
        runs.append(run)
    sweep = SweepFolder(folder, manifest, runs, writer)
    if running:
        sweep.state, sweep.detail = "running", writer.where
    elif sweep.count("completed") == len(runs):
        sweep.state = "completed"
    elif sweep.count("running"):
        sweep.state, sweep.detail = "running", "no sweep.lock, but a cell runs"
    elif sweep.count("pending") + sweep.count("interrupted"):
        sweep.state, sweep.detail = "interrupted", "no `fedmech sweep` runs it"
    else:
        sweep.state = "failed"
    done = [r.seconds for r in runs
            if r.status == "completed" and isinstance(r.seconds, (int, float)) and r.seconds > 0]
    sweep.median = statistics.median(done) if done else None
    if sweep.state == "running":
        sweep.eta = _sweep_eta(runs, sweep.median, manifest.get("parallel"))
    return sweep


def read_folder(path: str | Path) -> FolderRun | SweepFolder:
    """A run or sweep folder; anything else is a ``RunFolderError``."""
    path = Path(path).expanduser()
    if (path / SWEEP_MANIFEST_FILE).is_file():
        return read_sweep(path)
    if (path / STATUS_FILE).is_file():
        return read_run(path)
    if (path / LOCK_FILE).is_file() and not (path / CONFIG_FILE).is_file():
        return _not_started(path)
    if not path.exists():
        raise RunFolderError(f"{path} does not exist; give a run folder or a sweep folder")
    raise RunFolderError(f"{path} {NOT_A_FOLDER}")


def _not_started(path: Path) -> FolderRun:
    """A folder holding only what a ``fedmech run`` makes before its run starts (its
    lock, and the logs of a start that failed)."""
    writer = lock_writer(path / LOCK_FILE)
    if writer is not None and writer.state != "gone":
        return FolderRun(path.name, path, "running", writer=writer if writer.state == "elsewhere" else None)
    logs = " (its logs/ says why)" if (path / "logs").is_dir() else ""
    return FolderRun(path.name, path, "never started", error=(
        f"the fedmech process that made it ended before the run began{logs}; nothing to resume: delete the folder"))


def read_inputs(paths: list[Path]) -> tuple[dict[str, Any] | None, list[FolderRun]]:
    """The sweep manifest (None for run folders) and the runs the paths name: one sweep
    folder, or run folders (what ``fedmech report`` and ``fedmech export`` take)."""
    sweeps = [p for p in paths if (p / SWEEP_MANIFEST_FILE).is_file()]
    if sweeps and len(paths) > 1:
        raise ConfigError(f"give one sweep folder or several run folders, not both (got {len(paths)} paths, "
                          f"{len(sweeps)} sweep folder(s)); run the report once per sweep", "fedmech report")
    if sweeps:
        sweep = read_sweep(sweeps[0])
        return sweep.manifest, sweep.runs
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a folder: pass a sweep folder (with {SWEEP_MANIFEST_FILE}) or "
                                    "run folders")
    return None, [read_run(p) for p in paths]


@contextmanager
def recorded_outputs(runs: list[FolderRun], extra: list[str] = ()) -> Iterator[list[str]]:
    """Inside this block, ``runs`` are shown with the declarations they recorded when they
    ran (``outputs.reading``): no module a run folder names is imported, since opening
    someone's results must not run their code. A flagged value's flag is the one its own
    run recorded (a record is told apart by identity; one read again, as ``fedmech plot``
    does, by round, of a lone run). A run that recorded none (a folder from before runs
    did) is shown with the built-in plug-ins' declarations, its own plug-ins' metrics as
    recorded: one line each such run, which the block yields. ``extra`` (``--plugin``)
    modules are imported, as their user asks, and their declarations used."""
    plugins.load_built_in()
    for module in extra:
        plugins.import_plugin(module, f"--plugin {module}")
    registered = registered_outputs(built_in_only=not extra)
    declared = outputs_to_plain(registered)
    for run in runs:
        declared.update(run.outputs[0] if run.outputs else {})
    own = {id(record): run.outputs[1] for run in runs if run.outputs for record in run.records}
    lone = runs[0].outputs[1] if len(runs) == 1 and runs[0].outputs else None
    rules = metrics_of(registered)

    def flag_of(key: str, record: dict[str, Any]) -> str | None:
        """The flag its run recorded; for a run that recorded none, the built-in rule's."""
        flags = own.get(id(record), lone)
        if flags is not None:
            return flags.get(key, {}).get(str(record.get("round")))
        rule = rules[key].flag if key in rules else None
        return rule(record) if rule else None

    merged = outputs_from_plain(declared, flag_of)
    old = [f"{run.name} recorded no declarations (a folder from before runs did): its plug-ins' "
           f"({', '.join(map(str, named))}) metrics are shown as recorded; --plugin MODULE shows them as declared"
           for run in runs if run.outputs is None and (named := (run.config or {}).get("plugins"))]
    with reading(merged):
        yield old
