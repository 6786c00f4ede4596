"""How a run's cost grows with the federation: the same small experiment through
``fedmech run`` (real ``flwr run``, Ray) with 100, 10,000 and 100,000 simulated clients,
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

and the ratios of round time, RSS and start-up to the smallest count, with the targets
beside them (100,000 vs 100: round time and RSS at most 1.10x, start-up at most linear in
the clients). The counts run in turn, ``--repeats`` times, and the medians are compared:
on a shared machine single runs move by a factor of 2. Nothing gates on them.

    python benchmarks/scale.py [--clients 100 10000 100000] [--per-round 10] [--rounds 5] [--repeats 2]

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
SAMPLES_PER_CLIENT = 5
"""Training samples of each sampled client per round (the same at every client count)."""
MARKERS = [("serverapp", "Run folder:"), ("roster", "Starting RoundProtocol strategy"), ("to round 1", "[ROUND 1/")]
"""Start-up phases: each ends when its line arrives."""
TARGETS = {"round": 1.10, "rss": 1.10}
"""The largest count's ratio to the smallest that the issue asks for."""


def one_run(num_clients: int, num_train: int, per_round: int, rounds: int) -> dict[str, float]:
    """Start-up phases, median later round, peak server RSS and wall time of one run."""
    from fedmech_flwr.artifacts.folder import read_records

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
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 10_000, 100_000], help="smallest first")
    parser.add_argument("--per-round", type=int, default=10, help="clients sampled per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (at least 3: the median skips round 1)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per count, the counts taken in turn (the medians are shown)")
    args = parser.parse_args(argv)
    num_train = SAMPLES_PER_CLIENT * max(args.clients)  # one dataset for every run
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.clients}
    columns = ["serverapp", "roster", "to round 1", "start-up", "round 1", "round", "rss", "wall"]
    print(f"{'clients':>7} {'serverapp':>9} {'roster':>7} {'to rnd 1':>8} {'start-up':>8} {'round 1':>7} {'round':>6} "
          f"{'RSS MiB':>8} {'wall':>6}", flush=True)
    for _ in range(args.repeats):
        for n in args.clients:
            r = one_run(n, num_train, args.per_round, args.rounds)
            runs[n].append(r)
            print(f"{n:>7} " + " ".join(f"{r[c]:>{w}.{p}f}" for c, w, p in zip(
                columns, (9, 7, 8, 8, 7, 6, 8, 6), (1, 1, 1, 1, 1, 2, 0, 1))), flush=True)
    rows = {n: {c: statistics.median(r[c] for r in runs[n]) for c in columns} for n in args.clients}
    small = rows[args.clients[0]]
    print(f"\nmedians of {args.repeats} runs each")
    print(f"{'clients':>7} {'start-up':>8} {'round':>6} {'RSS MiB':>8} {'round x':>7} {'RSS x':>6} {'start-up x':>10}")
    for n, r in rows.items():
        print(f"{n:>7} {r['start-up']:>8.1f} {r['round']:>6.2f} {r['rss']:>8.0f} {r['round'] / small['round']:>7.3f} "
              f"{r['rss'] / small['rss']:>6.3f} {r['start-up'] / small['start-up']:>10.2f}")
    large = rows[args.clients[-1]]
    print(f"targets, {args.clients[-1]} vs {args.clients[0]} clients: round time x{large['round'] / small['round']:.3f} "
          f"(at most {TARGETS['round']}), server RSS x{large['rss'] / small['rss']:.3f} (at most {TARGETS['rss']}), "
          f"start-up x{large['start-up'] / small['start-up']:.2f} for x{args.clients[-1] / args.clients[0]:g} clients "
          f"(at most linear)")


if __name__ == "__main__":
    main()
