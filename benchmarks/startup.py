"""What a run costs beyond its rounds: a lone 1-round smoke ``fedmech run`` and the cells
of a 4-cell smoke ``fedmech sweep`` (its 1-round IID FedAvg cells, one per seed), each a
whole process, after one warm-up run.

For every run: the wall time, Flower's own "Strategy execution finished in" (the rounds),
the fixed cost (the difference), and where the lone run's went, from timestamps the run
leaves anyway: the SuperLink's request log (``logs/superlink.log``) and when the run
folder's files were written:

    start      CLI, validation, SuperLink and Ray start, app sent  up to Flower's start-run request
    simulate   the simulation process starts                 up to its pull-task-input request
    serverapp  ServerApp imports, data, run folder           up to config.yaml written
    rounds     the rounds (the first waits for the actors)   up to model_final.safetensors written
    finish     plots, event files, the status handed over    up to the last of plots/ and tensorboard/ written
    teardown   Flower's simulation stops, leaves Ray         up to its push-task-output request
    status     the run's end streamed, its status asked      up to the list-runs request
    page       logs kept, the run's page, then "completed"   up to status.json written
    exit       everything stopped, the process ends          up to the process's exit

    python benchmarks/startup.py [--repeats 3] [--cells 4] [--warm-up 1]

Since the roster is read without a message, the client actors start inside the first
round, so "strategy" (and "rounds") hold their start. Medians (min-max) over the repeats;
nothing here gates on time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FEDMECH = [sys.executable, "-m", "fedmech_flwr.tools.cli"]
LONE = ["run", "experiments/smoke.yaml", "--set", "federation.num_rounds=1"]
SWEEP = ["sweep", "experiments/smoke_sweep.yaml", "--preset", "quick", "--only", "strategy+client=fedavg",
         "--only", "data.partition=iid"]
"""The 1-round smoke sweep's IID FedAvg cells, one per seed (``--seeds``)."""
STRATEGY_S = re.compile(r"Strategy execution finished in ([0-9.]+)s")
REQUEST = re.compile(r"^(\S+Z) INFO \[uvicorn\.access\] .*\"POST /v1/\w+/([\w-]+) HTTP")
PHASES = [("start", "start-run"), ("simulate", "pull-task-input"), ("serverapp", "config.yaml"),
          ("rounds", "model_final.safetensors"), ("finish", "plots/ tensorboard/"), ("teardown", "push-task-output"),
          ("status", "list-runs"), ("page", "status.json")]
"""Each phase ends at a SuperLink request (its first), when a run-folder file was written, or
when the last file of the folders named was."""


def run_command(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd``; return when it started (epoch seconds) and its wall time."""
    started, start = time.time(), time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return started, time.perf_counter() - start


def phases(run: Path, started: float, wall: float) -> dict[str, float]:
    """Seconds per phase (see the module's doc), each from the end of the one before."""
    requests: dict[str, float] = {}
    for line in (run / "logs" / "superlink.log").read_text(errors="replace").splitlines():
        if m := REQUEST.match(line):
            at = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)
            requests.setdefault(m.group(2), at.timestamp())
    out, before = {}, 0.0
    for name, mark in PHASES:
        if mark.endswith("/"):
            at = max(p.stat().st_mtime for folder in mark.split() for p in (run / folder).iterdir())
        else:
            at = (run / mark).stat().st_mtime if "." in mark else requests.get(mark)
        if at is None:
            sys.exit(f"no {mark} request in {run}/logs/superlink.log: the log changed; update PHASES")
        out[name], before = at - started - before, at - started
    out["exit"] = wall - before
    return out


def strategy_seconds(text: str) -> float:
    found = STRATEGY_S.findall(text)
    if not found:
        sys.exit("no 'Strategy execution finished in' line: the log changed")
    return float(found[-1])


def lone_run(out: Path) -> dict[str, float]:
    started, wall = run_command([*FEDMECH, *LONE, "--out", str(out)])
    (run,) = out.iterdir()
    strategy = strategy_seconds((run / "logs" / "flwr_run.log").read_text())
    return {"wall": wall, "strategy": strategy, "fixed": wall - strategy, **phases(run, started, wall)}


def sweep_cells(out: Path, cells: int) -> list[dict[str, float]]:
    """Each cell's wall time (as the sweep measured it) and Flower's strategy time."""
    run_command([*FEDMECH, *SWEEP, "--seeds", ",".join(map(str, range(cells))), "--out", str(out)])
    folder = next(out.iterdir())
    manifest = json.loads((folder / "sweep.json").read_text())["cells"]
    rows = []
    for cell in manifest:
        strategy = strategy_seconds((folder / cell["run_dir"] / "logs" / "flwr_run.log").read_text())
        rows.append({"wall": cell["seconds"], "strategy": strategy, "fixed": cell["seconds"] - strategy})
    return rows


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="lone runs and sweeps measured (after a warm-up)")
    parser.add_argument("--cells", type=int, default=4, help="cells of the smoke sweep (one per seed)")
    parser.add_argument("--warm-up", type=int, default=1, help="lone runs before measuring (page cache, bytecode)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for i in range(args.warm_up):
            lone_run(Path(tmp) / f"warm-up{i}")
        runs = [lone_run(Path(tmp) / f"run{i}") for i in range(args.repeats)]
        sweeps = [sweep_cells(Path(tmp) / f"sweep{i}", args.cells) for i in range(args.repeats)]
    print("lone 1-round smoke run, seconds: median (min-max) over", args.repeats)
    for key in runs[0]:
        print(f"  {key:10} {_summary([r[key] for r in runs])}")
    print(f"smoke sweep, {args.cells} cells x {args.repeats} sweeps, seconds per cell")
    for position in range(args.cells):
        cells = [s[position] for s in sweeps]
        label = "first cell" if position == 0 else f"cell {position + 1}"
        print(f"  {label:10} wall {_summary([c['wall'] for c in cells])}  strategy "
              f"{_summary([c['strategy'] for c in cells])}  fixed {_summary([c['fixed'] for c in cells])}")
    later = [c["fixed"] for s in sweeps for c in s[1:]]
    if later:
        print(f"fixed cost per cell after the first: median {statistics.median(later):.1f} s")


if __name__ == "__main__":
    main()
