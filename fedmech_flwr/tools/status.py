"""``fedmech status``: where a run or a sweep stands, read from its folder alone.

Read-only: ``fedmech_flwr.artifacts.reader`` reads the folder (the same reader as ``fedmech
report`` and ``fedmech export``, with its one rule for a writer's liveness); this module
only words what it read. A writer on another host, as in a folder copied from another
machine, is named but not checked: this host cannot see its processes. Each line is
``safe_text.printable``: a folder's name, a run's error or a metric's key, all read from
files, cannot move the cursor, retitle the terminal or start a line of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.reader import (  # noqa: F401 (seconds_per_round: the pace behind its ETAs)
    FolderRun,
    SweepFolder,
    read_folder,
    read_run,
    read_sweep,
    recorded_outputs,
    seconds_per_round,
)
from fedmech_flwr.contracts import outputs
from fedmech_flwr.foundation.safe_text import printable


def _phrase(run: FolderRun) -> str:
    """``running (pid P on HOST)``, ``running on HOST (pid P), not checked from here``,
    ``failed: REASON``, ``interrupted: ...``, ``completed``."""
    writer = run.writer
    if run.status == "running":
        return f"running {writer.where}" if writer and writer.state == "elsewhere" else f"running ({run.note})"
    if run.status == "interrupted" and writer and writer.state == "gone":
        return f"interrupted: status.json says running, but its process {writer.pid} is gone from this host"
    return f"{run.status}: {run.note}" if run.note else run.status


def _progress(run: FolderRun) -> str:
    """``round k of N, ETA 20s``."""
    last = "-" if run.last_round is None else run.last_round
    eta = f"ETA {outputs.duration(run.eta)}" if run.eta is not None else "ETA unknown"
    return f"round {last} of {'?' if run.num_rounds is None else run.num_rounds}" + \
        (f", {eta}" if run.status == "running" else "")


def run_text(path: Path, run: FolderRun) -> str:
    """A run's state, round k of N (and ETA while it runs), the last round's headline
    metrics with their flags, and for a stopped run the command that continues it."""
    path = path.resolve()
    lines = [f"run {path.name}: {_phrase(run)}", f"  {_progress(run)}"]
    if run.last_round is not None:
        with recorded_outputs([run]) as undeclared_runs:  # what its plug-ins declared, none of them imported
            shown = outputs.headline([r for r in run.records if r["round"] == run.last_round])
            generic = undeclared_text(run.records, run.last_round)
        lines += [f"  {line}" for line in undeclared_runs]
        lines.append(f"  round {run.last_round}: {' | '.join(shown) or 'no headline metrics'}")
        if generic:
            lines.append(f"  {generic}")
    if run.status == "interrupted" or run.status == "failed" and run.resumable:
        lines.append(f"  continue it: fedmech run --resume {path}")
    elif run.status == "failed":
        lines.append("  a resume would fail the same way: fix the cause, then start a new run")
    return "\n".join(map(printable, lines))


def undeclared_text(records: list[dict[str, Any]], last_round: int) -> str:
    """``undeclared (as recorded): geometry.spread 0.412 | strategy.krum_selected 2.000``:
    the latest value of each metric a plug-in records without declaring it
    (``outputs.undeclared``), its round named where it is not the last; "" when none."""
    metrics = outputs.metrics_of(outputs.undeclared(records))
    shown = []
    for key, metric in metrics.items():
        if (found := outputs.latest(metric, records)) and isinstance(value := found[1], float):
            at = "" if found[0]["round"] == last_round else f" (round {found[0]['round']})"
            shown.append(f"{key} {outputs.show(metric, value)}{at}")
    return f"undeclared (as recorded): {' | '.join(shown)}" if shown else ""


def run_status(path: str | Path) -> str:
    return run_text(Path(path), read_run(Path(path)))


def sweep_text(folder: Path, sweep: SweepFolder) -> str:
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
        if cell.status == "running":
            lines.append(f"  {name}: {_phrase(cell)}, {_progress(cell)}")
        elif cell.status in ("failed", "interrupted"):
            lines.append(f"  {name}: {_phrase(cell)}")
    if sweep.state in ("failed", "interrupted"):
        retry = "; --retry-failed reruns its failed cells" if sweep.count("failed") else ""
        if command := sweep.manifest.get("command"):
            lines.append(f"  continue it: `{command}`{retry}")
        else:  # a sweep.json from before the command was kept
            lines.append(f"  continue it: run the same `fedmech sweep` command again (sweep folder "
                         f"{folder.resolve()}{retry})")
    return "\n".join(map(printable, lines))


def sweep_status(folder: str | Path) -> str:
    return sweep_text(Path(folder), read_sweep(Path(folder)))


def look(path: str | Path) -> tuple[FolderRun | SweepFolder, str]:
    """A run or sweep folder's state and its text; anything else is a ``RunFolderError``."""
    found = read_folder(path)
    if isinstance(found, SweepFolder):
        return found, sweep_text(found.path, found)
    return found, run_text(found.path, found)
