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
