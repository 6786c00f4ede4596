"""Cost of the resume point (``state.safetensors``, replaced every round) against a round.

Runs the throughput experiment (the default SimpleCNN [64, 128, 256] on Fashion-MNIST,
one client, 3000 samples per round) in process, times every write of the resume point,
and prints the median write time, the median round time (one commit to the next, the
write included) and their ratio.

    python benchmarks/resume_point.py [--rounds 4] [--experiment experiments/smoke.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "benchmarks" / "throughput.yaml"


def main() -> None:
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.app.inprocess import run_in_process
    from fedmech_flwr.spec.experiment import load_experiment
    from fedmech_flwr.artifacts.folder import STATE_FILE, RunFolder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--experiment", default=str(EXPERIMENT), help="another experiment file")
    args = parser.parse_args()
    plugins.load()
    cfg = load_experiment(args.experiment, [f"federation.num_rounds={args.rounds}"])
    writes: list[float] = []
    commits: list[float] = []
    save_state = RunFolder.save_state

    def timed(self, point):
        start = time.perf_counter()
        save_state(self, point)
        commits.append(time.perf_counter())
        writes.append(commits[-1] - start)

    RunFolder.save_state = timed
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        run = run_in_process(cfg, out)
        size = (run / STATE_FILE).stat().st_size
    rounds = [b - a for a, b in zip(commits, commits[1:])]
    write, round_s = statistics.median(writes[1:]), statistics.median(rounds)
    print(f"resume point: {size / 1e6:.2f} MB, written in {1e3 * write:.1f} ms (median of {len(writes) - 1} rounds)")
    print(f"round: {round_s:.2f} s (median, commit to commit)")
    print(f"ratio write / round: {write / round_s:.4f}")


if __name__ == "__main__":
    main()
