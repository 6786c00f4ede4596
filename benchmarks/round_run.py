"""What the one-round benchmarks (``circuits_round``, ``misalignment_round``,
``similarity_round``) share: parse ``[EXPERIMENT] [--rounds N] [--set key=value ...]``, run
the experiment in process (clients one after the other on the same threads) in a
temporary folder, and hand the run folder to the benchmark's own table."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.contracts import plugins
from fedmech_flwr.spec.experiment import load_experiment


def run_benchmark(description: str, default_experiment: Path, table: Callable[[Path], None],
                  argv: list[str] | None = None) -> None:
    """Run the benchmark's experiment for ``--rounds`` rounds, then ``table(run_dir)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("experiment", nargs="?", default=str(default_experiment))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    plugins.load()
    cfg = load_experiment(args.experiment, [f"federation.num_rounds={args.rounds}", *args.set])
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    with tempfile.TemporaryDirectory() as out:
        table(run_in_process(cfg, out))


def print_parts(rows: list[dict[str, float]], parts: tuple[str, ...], counts: dict[str, str] | None = None) -> None:
    """One line a round: training seconds, each of ``parts``' seconds, each of ``counts``
    (label: key, a whole number), and the parts' sum over training (the last column)."""
    width = max(len(p) for p in parts) + 3
    counts = counts or {}
    print(f"{'round':>5} {'training s':>11}" + "".join(f" {p + ' s':>{width}}" for p in parts)
          + "".join(f" {label:>10}" for label in counts) + f" {'ratio':>7}")
    for row in rows:
        print(f"{row['round']:>5} {row['training']:>11.1f}" + "".join(f" {row.get(p, 0.0):>{width}.2f}" for p in parts)
              + "".join(f" {row[key]:>10.0f}" for key in counts.values()) + f" {row['ratio']:>7.3f}")
