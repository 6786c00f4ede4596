"""How a run's cost grows with the federation: the same small experiment through
``fedmech run`` (real ``flwr run``, Ray) with 100, 1,000 and 10,000 simulated clients,
10 sampled per round, each sampled client training on the same number of samples (one
synthetic dataset, big enough for the largest count, for every run).

For each client count:

    start-up   from the process's start until Flower's "[ROUND 1/" line arrives, split
               at "Run folder:" (CLI, SuperLink, simulation, ServerApp start) and at the
               strategy's banner (the roster: node discovery, partitions.json; Ray
               starts meanwhile)
    round 1    the first round (eval records' ``elapsed_seconds``, round 1 minus round 0):
               it also waits for Ray and its actors to start, which start-up does not
    round      the median wall time of the rounds after the first, from the same records
    RSS        the ServerApp's peak RSS: ``server_peak_rss_mb`` of the last eval record.
               In simulation that process (``flwr-simulation``) also hosts Flower's
               simulation engine and the Ray driver, so Flower's per-node book-keeping
               is in it; the ClientApps run in Ray actors (other processes) and are not
    wall       the whole ``fedmech run`` process

and the ratios of round time and RSS to the smallest count, with the issue's targets
beside them (10,000 vs 100: round time at most 1.10x, RSS at most 1.05x; start-up at most
linear in the clients and under 60 s at 10,000). Nothing gates on them.

    python benchmarks/scale.py [--clients 100 1000 10000] [--per-round 10] [--rounds 5]

Flower streams a run's log in batches of about a second, so start-up is +-1 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "smoke.yaml"
MODEL = "model={name: simple_cnn, channels: [64, 128, 256]}"
"""The paper's SimpleCNN widths (1.4 MiB of weights): a server keeping every client's
model would show, and a sampled client still trains in a fraction of a second."""
SAMPLES_PER_CLIENT = 20
"""Training samples of each sampled client per round (the same at every client count)."""
MARKERS = [("serverapp", "Run folder:"), ("roster", "Starting RoundProtocol strategy"), ("to round 1", "[ROUND 1/")]
"""Start-up phases: each ends when its line arrives."""
TARGETS = {"round": 1.10, "rss": 1.05}
"""The largest count's ratio to the smallest that the issue asks for."""
STARTUP_LIMIT_S = 60.0


def one_run(num_clients: int, num_train: int, per_round: int, rounds: int) -> dict[str, float]:
    """Start-up phases, median later round, peak server RSS and wall time of one run."""
    from fedmech_flwr.run_folder import read_records

    overrides = [
        f"name=scale-{num_clients}",
        MODEL,
        f"federation.num_clients={num_clients}",
        f"federation.clients_per_round={per_round}",
        f"federation.num_rounds={rounds}",
        "data.partition={name: iid}",
        f"data.dataset.num_train={num_train}",
        f"train.max_samples_per_round={SAMPLES_PER_CLIENT}",
        "train.epochs=1",
    ]
    with tempfile.TemporaryDirectory(prefix="fedmech-scale-") as out:
        cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(EXPERIMENT), "--out", out, "--verbose"]
        for item in overrides:
            cmd += ["--set", item]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [(time.perf_counter() - start, line) for line in proc.stdout]
        wall = time.perf_counter() - start
        if proc.wait() != 0:
            sys.exit(f"the run with {num_clients} clients failed:\n{''.join(line for _, line in lines[-60:])}")
        evals = read_records(next(Path(out).iterdir()), "eval")
    result, before = {}, 0.0
    for name, marker in MARKERS:
        at = next((t for t, line in lines if marker in line), None)
        if at is None:
            sys.exit(f"no line with {marker!r} in the run's output: the log changed; update MARKERS")
        result[name], before = at - before, at
    elapsed = [e["elapsed_seconds"] for e in evals]  # rounds 0..R
    return {**result, "start-up": before, "round 1": elapsed[1] - elapsed[0],
            "round": statistics.median(b - a for a, b in zip(elapsed[1:], elapsed[2:])),
            "rss": evals[-1]["server_peak_rss_mb"], "wall": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000], help="smallest first")
    parser.add_argument("--per-round", type=int, default=10, help="clients sampled per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (at least 3: the median skips round 1)")
    args = parser.parse_args(argv)
    num_train = SAMPLES_PER_CLIENT * max(args.clients)  # one dataset for every run
    rows = {}
    print(f"{'clients':>7} {'serverapp':>9} {'roster':>7} {'to rnd 1':>8} {'start-up':>8} {'round 1':>7} {'round':>6} "
          f"{'RSS MiB':>8} {'wall':>6} {'round x':>7} {'RSS x':>6}", flush=True)
    for n in args.clients:
        r = rows[n] = one_run(n, num_train, args.per_round, args.rounds)
        base = rows[args.clients[0]]
        print(f"{n:>7} {r['serverapp']:>9.1f} {r['roster']:>7.1f} {r['to round 1']:>8.1f} {r['start-up']:>8.1f} "
              f"{r['round 1']:>7.1f} {r['round']:>6.2f} {r['rss']:>8.0f} {r['wall']:>6.1f} {r['round'] / base['round']:>7.3f} "
              f"{r['rss'] / base['rss']:>6.3f}", flush=True)
    small, large = args.clients[0], args.clients[-1]
    print(f"targets, {large} vs {small} clients: round time x{rows[large]['round'] / rows[small]['round']:.3f} "
          f"(at most {TARGETS['round']}), server RSS x{rows[large]['rss'] / rows[small]['rss']:.3f} "
          f"(at most {TARGETS['rss']}), start-up {rows[large]['start-up']:.1f} s (under {STARTUP_LIMIT_S:.0f} s; "
          f"at most linear: x{rows[large]['start-up'] / rows[small]['start-up']:.2f} for x{large / small:g} clients)")


if __name__ == "__main__":
    main()
