"""What a run costs beyond its rounds: a lone 1-round smoke ``fedmech run`` and the cells
of a 4-cell smoke ``fedmech sweep`` (its 1-round IID FedAvg cells, one per seed), each a
whole process, after one warm-up run.

For every run: the wall time, Flower's own "Strategy execution finished in" (the rounds),
the fixed cost (the difference), and where the lone run's went, read from when its log
lines arrive (lines the product and Flower print anyway):

    start      CLI, validation, SuperLink start      up to "Using SuperLink"
    submit     the app packaged, sent and installed  up to "Successfully started run"
    simulate   the simulation process starts         up to "Starting Flower Simulation"
    serverapp  ServerApp imports, data, run folder   up to "Run folder:"
    ray        Ray starting, the roster              up to Flower's strategy banner
    rounds     the strategy's rounds                 up to "Strategy execution finished"
    finish     final model, plots, status            up to "Run completed:"
    shutdown   Ray, simulation, SuperLink stopped    up to the process's exit

    python benchmarks/startup.py [--repeats 3] [--cells 4] [--warm-up 1]

In simulation the roster is read without a message, so Ray starts while the ServerApp
does and the first round waits for its actors. Flower streams a run's log in batches of
about a second, so each phase is +-1 s. Medians
(min-max) over the repeats; nothing here gates on time.
"""

from __future__ import annotations

import argparse
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
LONE = ["run", "experiments/smoke.yaml", "--set", "federation.num_rounds=1", "--verbose"]
"""Verbose: the phases are read from Flower's log lines, which the quiet console leaves out."""
SWEEP = ["sweep", "experiments/smoke_sweep.yaml", "--preset", "quick", "--only", "strategy+client=fedavg",
         "--only", "data.partition=iid"]
"""The 1-round smoke sweep's IID FedAvg cells, one per seed (``--seeds``)."""
STRATEGY_S = re.compile(r"Strategy execution finished in ([0-9.]+)s")
PHASES = [
    ("start", "Using SuperLink"),
    ("submit", "Successfully started run"),
    ("simulate", "Starting Flower Simulation"),
    ("serverapp", "Run folder:"),
    ("ray", "Starting RoundProtocol strategy"),
    ("rounds", "Strategy execution finished"),
    ("finish", "Run completed:"),
]


def timed_lines(cmd: list[str]) -> tuple[float, list[tuple[float, str]]]:
    """Run ``cmd``; return its wall time and each output line with its arrival time."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.perf_counter() - start, line) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{''.join(line for _, line in lines[-40:])}")
    return time.perf_counter() - start, lines


def phases(wall: float, lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per phase: from the previous marker line to this one's first arrival."""
    out, before = {}, 0.0
    for name, marker in PHASES:
        at = next((t for t, line in lines if marker in line), None)
        if at is None:
            sys.exit(f"no line with {marker!r} in the run's output: the log changed; update PHASES")
        out[name], before = at - before, at
    out["shutdown"] = wall - before
    return out


def strategy_seconds(text: str) -> float:
    found = STRATEGY_S.findall(text)
    if not found:
        sys.exit("no 'Strategy execution finished in' line: the log changed")
    return float(found[-1])


def lone_run(out: Path) -> dict[str, float]:
    wall, lines = timed_lines([*FEDMECH, *LONE, "--out", str(out)])
    strategy = strategy_seconds("".join(line for _, line in lines))
    return {"wall": wall, "strategy": strategy, "fixed": wall - strategy, **phases(wall, lines)}


def sweep_cells(out: Path, cells: int) -> list[dict[str, float]]:
    """Each cell's wall time (as the sweep measured it) and Flower's strategy time."""
    timed_lines([*FEDMECH, *SWEEP, "--seeds", ",".join(map(str, range(cells))), "--out", str(out)])
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
