"""One round's full circuit diagnostics vs that round's local training, same config.

Runs the experiment in-process (no Ray, every client one after the other on the same
threads, so the two costs are comparable) and reads the times from the run folder:
local training = the clients' ``train-seconds``; circuit diagnostics = client-side
discovery (local and global circuits) + the server side (IoUs, ablations).

    python benchmarks/circuits_round.py [EXPERIMENT] [--rounds 2] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fedmech_flwr import plugins
from fedmech_flwr.config import load_experiment
from fedmech_flwr.inprocess import run_in_process
from fedmech_flwr.run_folder import read_records

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(REPO / "experiments" / "circuits_fmnist_dirichlet.yaml"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    plugins.load()
    cfg = load_experiment(args.experiment, [f"federation.num_rounds={args.rounds}", *args.set])
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    with tempfile.TemporaryDirectory() as out:
        run_dir = run_in_process(cfg, out)
        clients = read_records(run_dir, "client")
        circuits = [r for r in read_records(run_dir, "diagnostic") if r["name"] == "circuits"]
    print(f"{'round':>5} {'training s':>11} {'client circuits s':>18} {'server s':>9} {'ratio':>7}")
    for rec in circuits:
        rnd = rec["round"]
        train = sum(c["train-seconds"] for c in clients if c["round"] == rnd)
        client = sum((s["local"] or 0) + (s["global"] or 0) for s in rec["client_seconds"].values())
        total = client + rec["seconds"]
        print(f"{rnd:>5} {train:>11.1f} {client:>18.1f} {rec['seconds']:>9.1f} {total / train:>7.2f}")


if __name__ == "__main__":
    main()
