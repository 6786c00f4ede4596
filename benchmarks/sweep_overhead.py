"""What ``fedmech sweep`` adds to a run: one cell through the sweep against a bare
``fedmech run`` of the same config, measured side by side (alternating, whole processes).

The sweep file has the experiment as its base and no axes, so its one cell runs exactly
the bare run's config; the difference is the sweep's own work (expanding and validating
the grid, the manifest and lock, reading the finished cell's numbers). Target: under 3 s
or 5% per cell, whichever is larger.

    python benchmarks/sweep_overhead.py [--repeats 3] [--experiment experiments/smoke.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (alternating)")
    parser.add_argument("--experiment", default=str(REPO / "experiments" / "smoke.yaml"))
    args = parser.parse_args()
    fedmech = [sys.executable, "-m", "fedmech_flwr.tools.cli"]
    with tempfile.TemporaryDirectory(prefix="sweep-overhead-") as tmp:
        sweep = Path(tmp) / "one_cell.yaml"
        sweep.write_text(yaml.safe_dump({"base": str(Path(args.experiment).resolve()), "name": "one-cell"}))
        bare, swept = [], []
        for i in range(args.repeats):
            bare.append(timed([*fedmech, "run", args.experiment, "--out", f"{tmp}/run{i}"]))
            swept.append(timed([*fedmech, "sweep", str(sweep), "--out", f"{tmp}/sweep{i}"]))
    run_s, sweep_s = statistics.median(bare), statistics.median(swept)
    overhead = sweep_s - run_s
    target = max(3.0, 0.05 * run_s)
    print(f"bare fedmech run:     median {run_s:.1f} s  ({', '.join(f'{s:.1f}' for s in bare)})")
    print(f"fedmech sweep, 1 cell: median {sweep_s:.1f} s  ({', '.join(f'{s:.1f}' for s in swept)})")
    print(f"overhead per cell: {overhead:+.1f} s ({100 * overhead / run_s:+.1f}%); target under {target:.1f} s")
    print(f"ratio sweep / run: {sweep_s / run_s:.3f}")


if __name__ == "__main__":
    main()
