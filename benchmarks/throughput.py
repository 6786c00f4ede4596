"""Local training throughput inside a real Flower simulation vs a plain PyTorch loop.

Runs, in one invocation and one after the other on the same machine:

1. a plain PyTorch loop: the experiment's model, pruning, optimiser, batch size and torch
   thread count, over the same client's data (``train_epochs``, the engine clients use);
2. the same experiment through ``fedmech run`` (real ``flwr run``, Ray, one client).

and prints samples/s for each and their ratios. Two in-Flower figures are given: the
client's own loop (measured inside the Ray actor), and the whole train round as the
server sees it (sending the model, client set-up, training, the reply), median over the
rounds after the first (the first round also decodes the dataset in the actor).

    python benchmarks/throughput.py [--samples 3000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "benchmarks" / "throughput.yaml"


def plain_loop(overrides: list[str], repeats: int) -> float:
    from fedmech_flwr import plugins
    from fedmech_flwr.config import load_experiment
    from fedmech_flwr.experiment import client_partitions, load_data, new_model
    from fedmech_flwr.pruning import MagnitudePruner
    from fedmech_flwr.training import local_steps, seed_everything, train_epochs

    plugins.load()
    cfg = load_experiment(EXPERIMENT, overrides)
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    bundle = load_data(cfg)
    idx = torch.from_numpy(client_partitions(cfg, bundle)[0])
    rates = []
    for r in range(repeats):
        generator = seed_everything(cfg.seed, 0, r)
        sub = idx[torch.randperm(len(idx), generator=generator)[: cfg.train.max_samples_per_round]]
        x, y = bundle.x_train[sub], bundle.y_train[sub]
        model = new_model(cfg, bundle)
        pruner = MagnitudePruner(model, cfg.pruning, total_steps=local_steps(len(x), cfg.train))
        stats = train_epochs(model, x, y, cfg.train, generator, torch.nn.functional.cross_entropy, pruner)
        rates.append(stats.samples_per_s)
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def in_flower(overrides: list[str]) -> tuple[float, float]:
    from fedmech_flwr.run_folder import read_records

    with tempfile.TemporaryDirectory(prefix="fedmech-bench-") as out:
        cmd = [sys.executable, "-m", "fedmech_flwr.cli", "run", str(EXPERIMENT), "--out", out]
        for item in overrides:
            cmd += ["--set", item]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the Flower run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        run_dir = next(Path(out).iterdir())
        clients = [r for r in read_records(run_dir, "client") if r["round"] > 1]
        evals = [r for r in read_records(run_dir, "eval") if r["round"] > 1]
    loop = statistics.median(r["train-samples-per-s"] for r in clients)
    whole = statistics.median(c["num_examples"] / e["train_round_seconds"] for c, e in zip(clients, evals))
    return loop, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3000, help="local samples per round")
    parser.add_argument("--rounds", type=int, default=4, help="Flower rounds (the first is excluded)")
    args = parser.parse_args()
    overrides = [f"train.max_samples_per_round={args.samples}", f"federation.num_rounds={args.rounds}"]
    os.environ.setdefault("FEDMECH_OUT", tempfile.gettempdir())
    plain = plain_loop(overrides, repeats=3)
    loop, whole = in_flower(overrides)
    print(f"{'measurement':<48}{'samples/s':>12}{'ratio':>9}")
    print(f"{'plain PyTorch loop':<48}{plain:>12.1f}{1.0:>9.3f}")
    print(f"{'in Flower: client training loop (Ray actor)':<48}{loop:>12.1f}{loop / plain:>9.3f}")
    print(f"{'in Flower: whole train round (server view)':<48}{whole:>12.1f}{whole / plain:>9.3f}")


if __name__ == "__main__":
    main()
