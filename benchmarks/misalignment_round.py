"""One round's misalignment diagnostic vs that round's local training, same config, one run.

The default (``benchmarks/misalignment_round.yaml``) is the paper's setting: CIFAR-10
over 10 clients, SimpleCNN [64, 128, 256], 5 local epochs over full shards, probe,
realigned head, tau-norm, NCM and CCVR. In-process (clients one after the other on the
same threads); local training is the clients' ``train_seconds``, the diagnostic is the
clients' class statistics (a features pass over each shard) and the server's parts
(features of the audit and test sets, probe, realigned heads, heads from client
statistics). The last column is diagnostic / training.

    python benchmarks/misalignment_round.py [EXPERIMENT] [--rounds 1] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fedmech_flwr import plugins
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.experiment import load_experiment
from fedmech_flwr.run_folder import read_records

REPO = Path(__file__).resolve().parents[1]
PARTS = ("client stats", "features", "probe", "probe_pooled", "realigned", "client_stats", "layers", "clients")


def round_parts(run_dir: Path) -> list[dict[str, float]]:
    """Per round: training seconds, each part's seconds and the ratio."""
    clients = read_records(run_dir, "client")
    rows = []
    for rec in (r for r in read_records(run_dir, "diagnostic") if r["name"] == "misalignment"):
        row = {"round": rec["round"], "training": sum(c["train_seconds"] for c in clients if c["round"] == rec["round"]),
               "client stats": sum(s or 0 for s in rec["client_seconds"].values()), **rec["server_seconds"]}
        row["ratio"] = sum(row.get(p, 0.0) for p in PARTS) / row["training"]
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, float]]) -> None:
    print(f"{'round':>5} {'training s':>11}" + "".join(f" {p + ' s':>15}" for p in PARTS) + f" {'ratio':>7}")
    for row in rows:
        print(f"{row['round']:>5} {row['training']:>11.1f}" + "".join(f" {row.get(p, 0.0):>15.2f}" for p in PARTS)
              + f" {row['ratio']:>7.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(REPO / "benchmarks" / "misalignment_round.yaml"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    plugins.load()
    cfg = load_experiment(args.experiment, [f"federation.num_rounds={args.rounds}", *args.set])
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    with tempfile.TemporaryDirectory() as out:
        print_table(round_parts(run_in_process(cfg, out)))


if __name__ == "__main__":
    main()
