"""One round's server-side diagnostics vs that round's local training, same config, one run.

The default (``benchmarks/similarity_round.yaml``) is the Fashion-MNIST cell of
``experiments/paper/v2_misalignment.yaml`` at its ``cpu`` budget with the
``representation_similarity`` and ``neural_collapse`` diagnostics. In-process (clients one
after the other on the same threads); local training is the clients' ``train_seconds``,
a diagnostic its record's ``seconds`` (its whole ``server_side``: every model's forward pass
on the audit images and what it computes from them). One column per diagnostic of the
experiment and its ratio to training.

    python benchmarks/similarity_round.py [EXPERIMENT] [--rounds 1] [--set key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedmech_flwr.artifacts.folder import read_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_run import run_benchmark  # noqa: E402  (a sibling script, also when loaded by path)

REPO = Path(__file__).resolve().parents[1]


def round_costs(run_dir: Path) -> list[dict[str, float]]:
    """Per round: training seconds and each diagnostic's seconds."""
    clients = read_records(run_dir, "client")
    rows: dict[int, dict[str, float]] = {}
    for rec in read_records(run_dir, "diagnostic"):
        row = rows.setdefault(rec["round"], {
            "round": rec["round"], "training": sum(c["train_seconds"] for c in clients if c["round"] == rec["round"])})
        row[rec["name"]] = rec["seconds"]
    return list(rows.values())


def print_table(rows: list[dict[str, float]]) -> None:
    names = [key for key in rows[0] if key not in ("round", "training")]
    print(f"{'round':>5} {'training s':>11}" + "".join(f" {n + ' s':>27} {'ratio':>7}" for n in names))
    for row in rows:
        print(f"{row['round']:>5} {row['training']:>11.1f}"
              + "".join(f" {row.get(n, float('nan')):>27.2f} {row.get(n, float('nan')) / row['training']:>7.3f}"
                        for n in names))


def main(argv: list[str] | None = None) -> None:
    run_benchmark(__doc__.split("\n")[0], REPO / "benchmarks" / "similarity_round.yaml",
                  lambda run_dir: print_table(round_costs(run_dir)), argv)


if __name__ == "__main__":
    main()
