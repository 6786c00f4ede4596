"""Server memory with many simulated clients and a fixed sample per round.

Runs the same small experiment through ``fedmech run`` (real ``flwr run``, Ray) with 100
and with 1,000 simulated clients, 10 sampled per round, each sampled client training on
the same number of samples (one synthetic dataset for both), and prints the ServerApp process's peak RSS for each and
their ratio (about 1 when the server holds only the sampled clients' models).

What is measured: every round the ServerApp logs ``server_peak_rss_mb``
(``getrusage(RUSAGE_SELF).ru_maxrss``) into its ``eval`` records, and the figure here is
the value after the last round, i.e. the peak over the whole run. In simulation that
process (``flwr-simulation``) also hosts Flower's simulation engine and the Ray driver, so
Flower's own per-node book-keeping is included; the ClientApps run in Ray actors
(other processes) and are not.

    python benchmarks/server_memory.py [--clients 100 1000] [--per-round 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "smoke.yaml"
MODEL = "model={name: simple_cnn, channels: [64, 128, 256]}"
"""The paper's SimpleCNN widths (1.4 MiB of weights): big enough that a server keeping
every client's model would show (1,000 x 1.4 MiB), small enough to train in seconds."""
SAMPLES_PER_CLIENT = 20
"""Training samples of each sampled client per round (the same at every client count)."""


def model_mib() -> float:
    """Size of one model's weights, MiB."""
    from fedmech_flwr import plugins
    from fedmech_flwr.experiment import load_data, load_experiment, new_model

    plugins.load()
    cfg = load_experiment(EXPERIMENT, [MODEL])
    return sum(t.numel() * t.element_size() for t in new_model(cfg, load_data(cfg)).state_dict().values()) / 2**20


def peak_rss(num_clients: int, num_train: int, per_round: int, rounds: int) -> tuple[float, float]:
    """(the ServerApp's peak RSS in MiB, wall seconds) of one run with ``num_clients``
    sharing a dataset of ``num_train`` samples."""
    from fedmech_flwr.run_folder import read_records

    overrides = [
        f"name=server-memory-{num_clients}",
        MODEL,
        f"federation.num_clients={num_clients}",
        f"federation.clients_per_round={per_round}",
        f"federation.num_rounds={rounds}",
        "data.partition={name: iid}",
        f"data.dataset.num_train={num_train}",
        f"train.max_samples_per_round={SAMPLES_PER_CLIENT}",
        "train.epochs=1",
    ]
    with tempfile.TemporaryDirectory(prefix="fedmech-bench-") as out:
        cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(EXPERIMENT), "--out", out]
        for item in overrides:
            cmd += ["--set", item]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"the run with {num_clients} clients failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        evals = read_records(next(Path(out).iterdir()), "eval")
    return evals[-1]["server_peak_rss_mb"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs=2, default=[100, 1000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--per-round", type=int, default=10, help="clients sampled per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    num_train = SAMPLES_PER_CLIENT * max(args.clients)  # one dataset for both runs
    results = {}
    for n in args.clients:
        results[n] = peak_rss(n, num_train, args.per_round, args.rounds)
        print(f"{n:>6} clients, {args.per_round} per round, {args.rounds} rounds: "
              f"ServerApp peak RSS {results[n][0]:.0f} MiB  (run {results[n][1]:.0f} s)", flush=True)
    small, large = args.clients
    print(f"ratio {large} / {small} clients: {results[large][0] / results[small][0]:.3f} "
          f"(keeping every client's model would add {(large - small) * model_mib():.0f} MiB to the larger run)")


if __name__ == "__main__":
    main()
