"""Local training throughput: the engine against a bare PyTorch loop, and in Flower.

Runs, in one invocation and one after the other on the same machine:

1. the project's engine (``train_epochs`` with its magnitude pruner) and a bare PyTorch
   loop written here (its own SimpleCNN, Adam step and magnitude pruning; no project
   code), alternated, on the same client's data, batch size, optimiser and torch threads;
2. the same experiment through ``fedmech run`` (real ``flwr run``, Ray, one client).

and prints samples/s for each and the ratios: the engine over the bare loop, and each
in-Flower figure over the engine. Two in-Flower figures are given: the client's own loop
(measured inside the Ray actor), and the whole train round as the server sees it
(sending the model, client set-up, training, the reply), median over the rounds after
the first (the first round also decodes the dataset in the actor). All three train on
``--device`` (auto: CUDA where torch sees it); on CUDA the Flower client holds a whole GPU.

    python benchmarks/throughput.py [--samples 3000] [--rounds 4] [--repeats 4] [--skip-flower] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "benchmarks" / "throughput.yaml"


def engine_vs_bare(overrides: list[str], repeats: int) -> tuple[float, float]:
    """samples/s of the project's engine (``train_epochs`` with its pruner) and of
    ``bare_loop``, alternated on the same data, model, batch, optimiser and threads; medians
    over the repeats after the first (a warm-up)."""
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.spec.experiment import client_partitions, load_data, load_experiment, new_model
    from fedmech_flwr.learning.pruning import MagnitudePruner
    from fedmech_flwr.foundation.seeds import seed_for
    from fedmech_flwr.learning.training import (cross_entropy_objective, local_steps, resolve_device, seed_everything,
                                       train_epochs)

    plugins.load()
    cfg = load_experiment(EXPERIMENT, overrides)
    torch.set_num_threads(cfg.simulation.cpus_per_client)
    device = resolve_device(cfg.device)
    bundle = load_data(cfg)
    idx = torch.from_numpy(client_partitions(cfg, bundle)[0])
    engine, bare = [], []
    for r in range(repeats):
        generator = seed_everything(seed_for(cfg.seed, "local-training", 0, r))
        sub = idx[torch.randperm(len(idx), generator=generator)[: cfg.train.max_samples_per_round]]
        x, y = bundle.x_train[sub].to(device), bundle.y_train[sub].to(device)
        model = new_model(cfg, bundle, device)
        pruner = MagnitudePruner(model, cfg.pruning, total_steps=local_steps(len(x), cfg.train))
        stats = train_epochs(model, x, y, cfg.train, generator, cross_entropy_objective(model), pruner)
        engine.append(stats.samples_per_s)
        bare.append(bare_loop(x, y, cfg.model.params.channels, bundle.num_classes, cfg.train.epochs, cfg.train.batch_size,
                              cfg.train.lr, cfg.pruning.target_sparsity, cfg.pruning.ramp_fraction, generator))
    keep = slice(1, None) if repeats > 1 else slice(None)
    return statistics.median(engine[keep]), statistics.median(bare[keep])


def bare_loop(x: torch.Tensor, y: torch.Tensor, channels: list[int], num_classes: int, epochs: int, batch_size: int,
              lr: float, sparsity: float, ramp_fraction: float, generator: torch.Generator) -> float:
    """samples/s of a loop written with nothing but PyTorch: the SimpleCNN (conv3x3-ReLU-
    maxpool blocks, a linear head), Adam, and after every step each conv layer pruned by
    magnitude to the cubic schedule's sparsity (the head left dense, as the engine does)."""
    layers, width, side = [], x.shape[1], x.shape[2]
    for c in channels:
        layers += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        width, side = c, side // 2
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(width * side * side, num_classes)).to(x.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    convs = [m.weight for m in model if isinstance(m, nn.Conv2d)]
    ramp = ramp_fraction * epochs * -(-len(x) // batch_size)
    step, start = 0, time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            target = sparsity * (1 - (1 - min(1.0, step / ramp)) ** 3) if ramp else sparsity
            with torch.no_grad():
                for w in convs:
                    if (k := round(target * w.numel())) > 0:
                        w.masked_fill_(w.abs() <= w.abs().flatten().kthvalue(k).values, 0.0)
    if x.is_cuda:  # the engine waits for every step (it reads the loss); so does this clock
        torch.cuda.synchronize()
    return epochs * len(x) / (time.perf_counter() - start)


def in_flower(overrides: list[str]) -> tuple[float, float]:
    from fedmech_flwr.artifacts.folder import read_records

    with tempfile.TemporaryDirectory(prefix="fedmech-bench-") as out:
        cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(EXPERIMENT), "--out", out]
        for item in overrides:
            cmd += ["--set", item]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the Flower run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        run_dir = next(Path(out).iterdir())
        clients = [r for r in read_records(run_dir, "client") if r["round"] > 1]
        evals = [r for r in read_records(run_dir, "eval") if r["round"] > 1]
    loop = statistics.median(r["train_samples_per_s"] for r in clients)
    whole = statistics.median(c["num_examples"] / e["train_round_seconds"] for c, e in zip(clients, evals))
    return loop, whole


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3000, help="local samples per round")
    parser.add_argument("--rounds", type=int, default=4, help="Flower rounds (the first is excluded)")
    parser.add_argument("--repeats", type=int, default=4, help="engine and bare runs, alternated (the first excluded)")
    parser.add_argument("--skip-flower", action="store_true", help="only the engine against the bare loop")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where all three train")
    args = parser.parse_args(argv)
    from fedmech_flwr.learning.training import resolve_device

    device = resolve_device(args.device).type  # the Flower client needs a GPU share to see CUDA in its Ray actor
    overrides = [f"train.max_samples_per_round={args.samples}", f"federation.num_rounds={args.rounds}",
                 f"device={device}", f"simulation.gpus_per_client={1 if device == 'cuda' else 0}"]
    os.environ.setdefault("FEDMECH_OUT", tempfile.gettempdir())
    plain, bare = engine_vs_bare(overrides, repeats=args.repeats)
    print(f"{'measurement, on ' + device:<48}{'samples/s':>12}{'ratio':>9}")
    print(f"{'bare PyTorch loop (no project code)':<48}{bare:>12.1f}{1.0:>9.3f}")
    print(f"{'the engine outside Flower (train_epochs)':<48}{plain:>12.1f}{plain / bare:>9.3f}")
    if args.skip_flower:
        return
    loop, whole = in_flower(overrides)
    print(f"{'in Flower: client training loop (Ray actor)':<48}{loop:>12.1f}{loop / plain:>9.3f}")
    print(f"{'in Flower: whole train round (server view)':<48}{whole:>12.1f}{whole / plain:>9.3f}")


if __name__ == "__main__":
    main()
