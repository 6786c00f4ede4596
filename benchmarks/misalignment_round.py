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

import sys
from pathlib import Path

from fedmech_flwr.artifacts.folder import read_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_run import print_parts, run_benchmark  # noqa: E402  (a sibling script, also when loaded by path)

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


def main(argv: list[str] | None = None) -> None:
    run_benchmark(__doc__.split("\n")[0], REPO / "benchmarks" / "misalignment_round.yaml",
                  lambda run_dir: print_parts(round_parts(run_dir), PARTS), argv)


if __name__ == "__main__":
    main()
