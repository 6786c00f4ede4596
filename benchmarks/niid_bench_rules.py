"""SCAFFOLD and FedNova as fedmech runs them beside the same methods as NIID-Bench's code
writes them, one run each, on the same data, split, initial model and batch order.

NIID-Bench (Li et al. 2022, "Federated Learning on Non-IID Data Silos: An Experimental
Study", ICDE; ``train_net_scaffold`` and ``train_net_fednova`` with their server loops in
its ``experiments.py``) writes both rules another way than fedmech's clients and strategies:

- SCAFFOLD (option II): a plain SGD step on the cross-entropy, then y -= lr (c - c_i) on the
  weights; c_i+ = c_i - c + (x - y) / (K lr) with K every step taken, over all local epochs; the server takes the
  example-weighted mean of the y_i and c += sum(delta c_i) / N.
- FedNova: SGD with momentum rho for tau steps, every step of every local epoch; ||a_i||_1
  accumulated step by step as the authors' code does (a counter c <- rho c + 1 summed over
  the steps, their ``local_normalizing_vec``), d_i = (x - y_i) / ||a_i||_1; the server steps
  x -= (sum p_i ||a_i||_1) sum p_i d_i with p_i the clients' shares of the examples.

The references below are those rules on fedmech's data, split, initial model and batch
order, so a run and its reference can only differ by the rule (and float rounding). Per
round: each one's test accuracy and loss, and the method's own number (the norm of
SCAFFOLD's c, FedNova's tau_eff).

    python benchmarks/niid_bench_rules.py [--method scaffold|fednova] [EXPERIMENT] [--set key=value ...]

The default is the leaderboard's Fashion-MNIST cell at Dirichlet 0.05, seed 0, without
diagnostics, with each method's local SGD in the leaderboard but the learning rate: SCAFFOLD
with plain SGD at lr 0.05, where both diverge (docs/explanation/leaderboard.md;
``--set train.lr=0.02`` runs both 20 rounds), FedNova with momentum 0.9 at lr 0.05.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from torch import nn

from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.contracts import plugins
from fedmech_flwr.foundation.seeds import seed_for
from fedmech_flwr.learning.training import evaluate, seed_everything
from fedmech_flwr.spec.config import ExperimentConfig
from fedmech_flwr.spec.experiment import client_partitions, load_data, load_experiment, new_model

REPO = Path(__file__).resolve().parents[1]
LEADERBOARD_CELL = [
    "data.partition={name: dirichlet, alpha: 0.05, min_samples: 50}", "pruning.mode=dense",
    "train={optimizer: sgd, lr: 0.05, momentum: 0, epochs: 1, batch_size: 64, max_samples_per_round: 500}",
    "federation.num_rounds=20", "diagnostics=[]", "seed=0", "device=cpu",
]
METHODS = {
    "scaffold": ["strategy={name: scaffold}", "client={name: scaffold}"],
    "fednova": ["strategy={name: fednova}", "client={name: fednova}", "train.momentum=0.9"],
}
STATISTIC = {"scaffold": ("|c|", "scaffold_control_norm"), "fednova": ("tau_eff", "fednova_tau_eff")}
"""Per method: its own number's column name and strategy record key."""

Round = tuple[float, float, float]
"""Test accuracy, test loss and the method's own number after one round."""


def reference(cfg: ExperimentConfig) -> list[Round]:
    """NIID-Bench's rule of ``cfg.strategy.name`` on ``cfg``'s data, split, initial model and
    batch order, with full participation; it stops after the first round whose test loss is
    not finite."""
    scaffold = cfg.strategy.name == "scaffold"
    bundle = load_data(cfg)
    parts = client_partitions(cfg, bundle)
    lr, rho, batch, cap = cfg.train.lr, cfg.train.momentum, cfg.train.batch_size, cfg.train.max_samples_per_round
    model = new_model(cfg, bundle)
    names = [name for name, _ in model.named_parameters()]
    x = {k: v.clone() for k, v in model.state_dict().items()}
    c = {n: torch.zeros_like(x[n]) for n in names}
    c_local = [{n: torch.zeros_like(x[n]) for n in names} for _ in parts]
    rounds = []
    for server_round in range(1, cfg.federation.num_rounds + 1):
        trained, sizes, steps_taken, norms, deltas = [], [], [], [], []
        for i, part in enumerate(parts):
            idx = torch.from_numpy(part)
            data, labels = bundle.x_train[idx], bundle.y_train[idx]
            generator = seed_everything(seed_for(cfg.seed, "local-training", i, server_round))
            if cap is not None and cap < len(data):
                pick = torch.randperm(len(data), generator=generator)[:cap]
                data, labels = data[pick], labels[pick]
            net = new_model(cfg, bundle)
            net.load_state_dict(x)
            net.train()
            optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=rho)
            steps, counter, normalising = 0, 0.0, 0.0
            for _ in range(cfg.train.epochs):
                order = torch.randperm(len(data), generator=generator)
                for start in range(0, len(data), batch):
                    b = order[start:start + batch]
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(net(data[b]), labels[b]).backward()
                    optimizer.step()
                    if scaffold:
                        with torch.no_grad():
                            for name, p in net.named_parameters():
                                p -= lr * (c[name] - c_local[i][name])
                    steps += 1
                    counter = counter * rho + 1  # the authors' FedNova code's local_counter and
                    normalising += counter  # local_normalizing_vec: ||a_i||_1, step by step
            y = {k: v.detach().clone() for k, v in net.state_dict().items()}
            if scaffold:
                new = {n: c_local[i][n] - c[n] + (x[n] - y[n]) / (steps * lr) for n in names}
                deltas.append({n: new[n] - c_local[i][n] for n in names})
                c_local[i] = new
            trained.append(y)
            sizes.append(float(len(data)))
            steps_taken.append(steps)
            norms.append(normalising)
        share = [n / sum(sizes) for n in sizes]
        if scaffold:
            x = {k: sum(p * y[k].double() for p, y in zip(share, trained)).float() for k in x}
            c = {n: c[n] + sum(d[n] for d in deltas) / len(parts) for n in names}
            own = math.sqrt(sum(float((v.double() ** 2).sum()) for v in c.values()))
        else:
            own = sum(p * a_i for p, a_i in zip(share, norms))  # tau_eff
            d = {k: sum(p * (x[k].double() - y[k].double()) / a_i for p, y, a_i in zip(share, trained, norms))
                 for k in x}
            x = {k: (x[k].double() - own * d[k]).float() for k in x}
        model.load_state_dict(x)
        result = evaluate(model.eval(), bundle.x_test, bundle.y_test, bundle.num_classes, cfg.eval_batch_size)
        rounds.append((result.accuracy, result.loss, own))
        if not math.isfinite(result.loss):
            break
    return rounds


def fedmech(cfg: ExperimentConfig, out: Path) -> list[Round]:
    """fedmech's run of ``cfg`` in this process, up to its last round (a diverged run stops)."""
    try:
        run = run_in_process(cfg, out)
    except Exception as error:  # a diverged run raises after recording its rounds
        print(f"fedmech's run stopped: {type(error).__name__}: {error}")
        (run,) = [p for p in out.iterdir() if p.is_dir()]
    key = STATISTIC[cfg.strategy.name][1]
    own = {r["round"]: r[key] for r in read_records(run, "strategy")}
    return [(r["accuracy"], r["loss"], own[r["round"]]) for r in read_records(run, "eval") if r["round"] in own]


def print_table(method: str, ours: list[Round], theirs: list[Round]) -> None:
    own = STATISTIC[method][0]
    print(f"{'round':>5} {'fedmech acc':>12} {'loss':>12} {own:>12}   {'NIID-Bench acc':>14} {'loss':>12} {own:>12}")
    for i in range(max(len(ours), len(theirs))):
        left = "{:>12.4f} {:>12.6g} {:>12.6g}".format(*ours[i]) if i < len(ours) else f"{'–':>12} {'':>12} {'':>12}"
        right = "{:>14.4f} {:>12.6g} {:>12.6g}".format(*theirs[i]) if i < len(theirs) else f"{'–':>14}"
        print(f"{i + 1:>5} {left}   {right}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(REPO / "experiments" / "misalignment_fmnist.yaml"))
    parser.add_argument("--method", choices=sorted(METHODS), default="scaffold")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    plugins.load()
    cfg = load_experiment(args.experiment, [*LEADERBOARD_CELL, *METHODS[args.method], *args.set])
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    with tempfile.TemporaryDirectory() as out:
        ours = fedmech(cfg, Path(out))
    print_table(args.method, ours, reference(cfg))


if __name__ == "__main__":
    main()
