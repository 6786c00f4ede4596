"""``fedmech status``: where a run or a sweep stands, read from its folder alone.

Read-only, and only what is committed: whole metrics.jsonl lines (``read_records`` skips a
torn last one), status.json, sweep.json and sweep.lock (each replaced or made
atomically). A writer on another host, as in a folder copied from another machine, is
named but not checked: this host cannot see its processes.
"""

from __future__ import annotations

import json
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmech_flwr import outputs
from fedmech_flwr.config import load_plugins, read_yaml
from fedmech_flwr.errors import BadFileError, ConfigError, RunFolderError
from fedmech_flwr.run_folder import CONFIG_FILE, STATUS_FILE, process_alive, read_records, read_status, writer_gone
from fedmech_flwr.tools.sweep import LOCK_FILE, MANIFEST_FILE

NOT_A_FOLDER = ("is neither a run folder (status.json, config.yaml and metrics.jsonl, made by `fedmech run`) nor a "
                "sweep folder (sweep.json and runs/, made by `fedmech sweep`)")


@dataclass
class RunState:
    state: str
    """completed | failed | running | interrupted (status.json says running, its writer is
    gone) | pending (a sweep cell not started yet)"""
    detail: str
    """Why it stopped, or where it runs: ``(pid P on HOST)``."""
    last_round: int | None
    """The last round with an eval record; None before the first."""
    num_rounds: int | None
    eta: float | None = None
    """Seconds left, for a running run whose pace is known."""
    resumable: bool = True
    """False when status.json says a resume would fail the same way."""
    config: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state in ("completed", "running")


@dataclass
class SweepState:
    name: str
    state: str
    """completed | running | failed (nothing left to run but failed cells) | interrupted"""
    detail: str
    cells: dict[str, RunState]
    eta: float | None
    """Seconds left, for a running sweep whose pace is known."""
    median: float | None
    """The median wall time of a completed cell."""

    def count(self, state: str) -> int:
        return sum(cell.state == state for cell in self.cells.values())

    @property
    def ok(self) -> bool:
        return self.state in ("completed", "running") and not self.count("failed") + self.count("interrupted")


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


def _num_rounds(config: dict[str, Any], path: Path) -> int:
    rounds = (config.get("federation") or {}).get("num_rounds")
    if not isinstance(rounds, int):
        raise BadFileError(f"{path}: expected an integer federation.num_rounds, got {rounds!r}; the file was damaged")
    return rounds


def read_run(path: Path) -> RunState:
    """A run folder's state, its last evaluated round and, while it runs, its ETA."""
    status = read_status(path)
    config = read_yaml(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else {}
    num_rounds = _num_rounds(config, path / CONFIG_FILE) if config else None
    try:
        records = read_records(path)
    except FileNotFoundError:  # killed, or still starting, before its first record
        records = []
    evals = [r for r in records if r["kind"] == "eval"]
    last = evals[-1]["round"] if evals else None
    run = RunState(status["status"], "", last, num_rounds, config=config, records=records)
    pid, host = status.get("pid"), status.get("host")
    if run.state == "failed":
        run.detail = status.get("error") or "no reason recorded"
        run.resumable = status.get("resumable") is not False
    elif run.state == "running" and writer_gone(status):
        run.state, run.detail = "interrupted", f"status.json says running, but its process {pid} is gone from this host"
    elif run.state == "running":
        pace = seconds_per_round(evals)
        if pace is not None and num_rounds is not None and last is not None:
            run.eta = pace * (num_rounds - last)
        run.detail = f"(pid {pid} on {host})" if host == socket.gethostname() else \
            f"on {host} (pid {pid}), not checked from here"
    elif run.state != "completed":
        raise BadFileError(f"{path / STATUS_FILE}: status {run.state!r} is none of running, completed, failed; the "
                           'file was damaged: restore it, or write {"status": "failed"} into it')
    return run


def _phrase(run: RunState) -> str:
    """``running (pid P on HOST)``, ``failed: REASON``, ``completed``."""
    if run.state == "running":
        return f"running {run.detail}"
    return f"{run.state}: {run.detail}" if run.detail else run.state


def _progress(run: RunState) -> str:
    """``round k of N, ETA 20s``."""
    last = "-" if run.last_round is None else run.last_round
    eta = f"ETA {outputs.duration(run.eta)}" if run.eta is not None else "ETA unknown"
    return f"round {last} of {'?' if run.num_rounds is None else run.num_rounds}" + \
        (f", {eta}" if run.state == "running" else "")


def run_text(path: Path, run: RunState) -> str:
    """A run's state, round k of N (and ETA while it runs), the last round's headline
    metrics with their flags, and for a stopped run the command that continues it."""
    path = path.resolve()
    lines = [f"run {path.name}: {_phrase(run)}", f"  {_progress(run)}"]
    if run.last_round is not None:
        try:  # the run's own plug-ins declare their metrics
            load_plugins(run.config, str(path / CONFIG_FILE))
        except ConfigError as err:
            lines.append(f"  its plug-ins' metrics are left out: {err}")
        shown = outputs.headline([r for r in run.records if r["round"] == run.last_round])
        lines.append(f"  round {run.last_round}: {' | '.join(shown) or 'no headline metrics'}")
    if run.state == "interrupted" or run.state == "failed" and run.resumable:
        lines.append(f"  continue it: fedmech run --resume {path}")
    elif run.state == "failed":
        lines.append("  a resume would fail the same way: fix the cause, then start a new run")
    return "\n".join(lines)


def run_status(path: str | Path) -> str:
    return run_text(Path(path), read_run(Path(path)))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ``{}`` when it is gone (a lock released just now)."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as err:
        raise BadFileError(f"{path} is not JSON ({err}); the file was damaged") from None
    if not isinstance(doc, dict):
        raise BadFileError(f"{path}: expected a JSON object, got {str(doc)[:80]}; the file was damaged")
    return doc


def _cell(entry: dict[str, Any], run_dir: Path, sweep_running: bool) -> RunState:
    """A sweep cell's state: its run folder's where it has one (a killed sweep leaves its
    manifest saying "running"), but failed when the manifest says so and it did not
    complete (the sweep reruns it only with --retry-failed); else the manifest's."""
    if (run_dir / STATUS_FILE).is_file():
        run = read_run(run_dir)
        if entry.get("status") == "failed" and run.state != "completed":
            run.state, run.detail = "failed", entry.get("error") or run.detail
        return run
    rounds = ((entry.get("config") or {}).get("federation") or {}).get("num_rounds")
    if entry.get("status") == "failed":
        return RunState("failed", entry.get("error") or "no reason recorded", None, rounds)
    if entry.get("status") == "running" and sweep_running:
        return RunState("running", "(starting)", None, rounds)
    return RunState("pending", "", None, rounds)


def _sweep_eta(cells: dict[str, RunState], median: float | None, parallel: int | None) -> float | None:
    """The cells left times the median cell, over the cells run at once (the sweep's
    --parallel; in an older sweep.json, which lacks it, the cells running now), plus the
    longest time a running cell has left (one of unknown pace: the median)."""
    running = [c for c in cells.values() if c.state == "running"]
    left = [c.eta if c.eta is not None else median for c in running]
    waiting = sum(c.state in ("pending", "interrupted") for c in cells.values())
    if None in left or (waiting and median is None):
        return None
    at_once = parallel or max(1, len(running))
    return (waiting * median / at_once if waiting else 0.0) + max(left, default=0.0)


def read_sweep(folder: Path) -> SweepState:
    """A sweep folder's cells by state, and its ETA while it runs."""
    manifest = _read_json(folder / MANIFEST_FILE)
    cells = manifest.get("cells")
    if not isinstance(cells, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                              and isinstance(e.get("run_dir"), str) for e in cells):
        raise BadFileError(f"{folder / MANIFEST_FILE}: expected a sweep manifest, a list of cells each with a name "
                           "and a run_dir; the file was damaged")
    holder = _read_json(folder / LOCK_FILE)
    here = holder.get("host") == socket.gethostname()
    sweep_running = bool(holder) and (not here or process_alive(holder.get("pid", -1)))
    cells = {e["name"]: _cell(e, folder / e["run_dir"], sweep_running) for e in manifest["cells"]}
    count = {s: sum(c.state == s for c in cells.values()) for s in ("completed", "running", "pending", "interrupted")}
    detail = ""
    if sweep_running:
        state = "running"
        detail = (f"pid {holder.get('pid')} on {holder.get('host')}" if here
                  else f"on {holder.get('host')} (pid {holder.get('pid')}), not checked from here")
    elif count["completed"] == len(cells):
        state = "completed"
    elif count["running"]:
        state, detail = "running", "no sweep.lock, but a cell runs"
    elif count["pending"] + count["interrupted"]:
        state, detail = "interrupted", "no `fedmech sweep` runs it"
    else:
        state = "failed"
    done = [e["seconds"] for e in manifest["cells"] if cells[e["name"]].state == "completed"
            and isinstance(e.get("seconds"), (int, float)) and e["seconds"] > 0]
    median = statistics.median(done) if done else None
    eta = _sweep_eta(cells, median, manifest.get("parallel")) if state == "running" else None
    return SweepState(manifest.get("name", folder.name), state, detail, cells, eta, median)


def sweep_text(folder: Path, sweep: SweepState) -> str:
    """The cells counted by state, each running cell's round and ETA, each failed cell's
    reason, the whole sweep's ETA, and for a stopped sweep how to continue it."""
    counts = ", ".join(f"{sweep.count(s)} {s}" for s in ("completed", "failed", "running", "interrupted", "pending"))
    lines = [f"sweep {sweep.name}: {sweep.state}" + (f" ({sweep.detail})" if sweep.detail else ""),
             f"  {len(sweep.cells)} cells: {counts}"]
    if sweep.state == "running":
        lines[-1] += f"; ETA {outputs.duration(sweep.eta)}" if sweep.eta is not None else "; ETA unknown"
        if sweep.median is not None:
            lines[-1] += f" (median cell {outputs.duration(sweep.median)})"
    for name, cell in sweep.cells.items():
        if cell.state == "running":
            lines.append(f"  {name}: {_phrase(cell)}, {_progress(cell)}")
        elif cell.state in ("failed", "interrupted"):
            lines.append(f"  {name}: {_phrase(cell)}")
    if sweep.state in ("failed", "interrupted"):
        retry = "; --retry-failed reruns its failed cells" if sweep.count("failed") else ""
        lines.append(f"  continue it: run the same `fedmech sweep` command again (sweep folder {folder.resolve()}"
                     f"{retry})")
    return "\n".join(lines)


def sweep_status(folder: str | Path) -> str:
    return sweep_text(Path(folder), read_sweep(Path(folder)))


def look(path: str | Path) -> tuple[RunState | SweepState, str]:
    """A run or sweep folder's state and its text; anything else is a ``RunFolderError``."""
    path = Path(path).expanduser()
    if (path / MANIFEST_FILE).is_file():
        sweep = read_sweep(path)
        return sweep, sweep_text(path, sweep)
    if (path / STATUS_FILE).is_file():
        run = read_run(path)
        return run, run_text(path, run)
    if not path.exists():
        raise RunFolderError(f"{path} does not exist; give a run folder or a sweep folder")
    raise RunFolderError(f"{path} {NOT_A_FOLDER}")
