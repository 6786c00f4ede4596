"""What the TensorBoard event files cost a round, same config, one run (in process).

Times ``EventFiles.round`` (every declared metric of the round, per-class values and
flags, written and flushed) against the round's wall time (``elapsed_seconds`` between
consecutive eval records), and the final ``EventFiles.close`` (the plots as images)
against the whole run. The default is experiments/default.yaml.

    python benchmarks/tensorboard_cost.py [EXPERIMENT] [--rounds 3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedmech_flwr.app import tensorboard_events
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.contracts import plugins
from fedmech_flwr.spec.experiment import load_experiment

REPO = Path(__file__).resolve().parents[1]


def timed(cls: type, name: str, seconds: list[float]) -> None:
    """Wrap ``cls.name`` so that each call's wall time is appended to ``seconds``."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(REPO / "experiments" / "default.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    plugins.load()
    torch.set_num_threads(1)
    cfg = load_experiment(args.experiment, [f"federation.num_rounds={args.rounds}", "tensorboard=true", *args.set])
    per_round, at_end = [], []
    timed(tensorboard_events.EventFiles, "round", per_round)
    timed(tensorboard_events.EventFiles, "close", at_end)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run = run_in_process(cfg, out)
        total = time.perf_counter() - start
        elapsed = [r["elapsed_seconds"] for r in read_records(run, "eval")]
    rounds = [b - a for a, b in zip(elapsed, elapsed[1:])]
    events = per_round[1:]  # round 0 has no training to compare with
    print(f"{cfg.name}: {len(rounds)} rounds, median round {statistics.median(rounds):.2f} s")
    print(f"event files per round: median {1000 * statistics.median(events):.1f} ms = "
          f"{100 * statistics.median(events) / statistics.median(rounds):.3f}% of a round")
    print(f"plots as images at the end: {1000 * sum(at_end):.0f} ms = {100 * sum(at_end) / total:.3f}% of the run")


if __name__ == "__main__":
    main()
