"""One round's circuit diagnostics vs that round's local training, same config, one run.

The default (``benchmarks/circuits_round.yaml``) is the paper's setting: CIFAR-10 over 10
clients (Dirichlet 0.5), SimpleCNN [64, 128, 256] at 99.9% sparsity, 5 local epochs over
full shards, the paper's gates (STE, init 2.0, Adam 0.1, lambda 0.01, 300 steps), the
diagnostic's 500 ablation images. It runs in-process (no Ray, clients one after the other on the same
threads, so the costs compare) and reads the times from the run folder: local training
is the clients' ``train_seconds``; the circuit diagnostics are the client-side discovery
of local and global circuits and the server side (IoUs, prediction checks, ablations).
The last column is diagnostics / training.

    python benchmarks/circuits_round.py [EXPERIMENT] [--rounds 1] [--set key=value ...]

On 2 CPU cores a full round takes about 12 minutes, most of it the clients' training;
``--set federation.clients_per_round=1`` keeps one client's round (the ratio is per
client, but for the server's share).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from fedmech_flwr.artifacts.folder import read_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_run import print_parts, run_benchmark  # noqa: E402  (a sibling script, also when loaded by path)

REPO = Path(__file__).resolve().parents[1]
PARTS = ("local discovery", "global discovery", "iou", "checks", "ablations")


def round_parts(run_dir: Path) -> list[dict[str, float]]:
    """Per round: training seconds, each diagnostic part's seconds, steps and the ratio."""
    clients = read_records(run_dir, "client")
    rows = []
    for rec in (r for r in read_records(run_dir, "diagnostic") if r["name"] == "circuits"):
        seconds = rec["client_seconds"].values()
        server = rec.get("server_seconds", {})
        row = {
            "round": rec["round"],
            "training": sum(c["train_seconds"] for c in clients if c["round"] == rec["round"]),
            "local discovery": sum(s["local"] or 0 for s in seconds),
            "global discovery": sum(s["global"] or 0 for s in seconds),
            "iou": server.get("iou", 0.0) + server.get("audit_discovery", 0.0),
            "checks": server.get("checks", 0.0),
            "ablations": server.get("ablations", rec["seconds"] if not server else 0.0),
            "steps": statistics.mean([v for s in rec.get("client_steps", {}).values() for v in s.values()
                                      if v is not None] or [0]),
        }
        row["ratio"] = sum(row[p] for p in PARTS) / row["training"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    run_benchmark(__doc__.split("\n")[0], REPO / "benchmarks" / "circuits_round.yaml",
                  lambda run_dir: print_parts(round_parts(run_dir), PARTS, {"gate steps": "steps"}), argv)


if __name__ == "__main__":
    main()
