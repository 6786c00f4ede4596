"""Does anything of a run outlive a SIGKILL of the command that started it?

Starts ``fedmech run`` of the smoke experiment (and ``fedmech sweep`` of the smoke
sweep), SIGKILLs the command alone (not its process group) at a random moment after it
started its first process, and
``--wait`` seconds later counts what it had started that is still alive. What it started
is watched from outside, independently of the reaper's own rule: every descendant of the
command seen while it ran (Ray's agents among them, before they are orphaned), and every
process whose working directory is in one of the launches' private folders.

    python benchmarks/orphans.py [--runs 10] [--sweeps 3] [--wait 5] [--seed 0]

Prints one row per kill and the count of kills that left something alive; exits 1 if
any did.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = ["run", "experiments/smoke.yaml", "--set", "federation.num_rounds=30"]
SWEEP = ["sweep", "experiments/smoke_sweep.yaml", "--only", "strategy+client=fedavg"]
RUN_KILL_S = (0.0, 15.0)
"""When to kill a run, in seconds after it started its first process (the launch's reaper,
then Ray and the SuperLink): from their start to its rounds (under way after ~10 s)."""
SWEEP_KILL_S = (0.0, 40.0)
START_TIMEOUT_S = 300.0
"""How long the command may take to start its first process (a loaded machine)."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[1]), int(fields[19])) if fields[0] != "Z" else None


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every live process below ``root``."""
    children: dict[int, list[int]] = {}
    started = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            started[int(entry.name)] = stat[1]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
    except OSError:
        return None


def in_folders(folders: set[str]) -> set[int]:
    """Live processes whose working directory is in one of ``folders``."""
    return {int(p.name) for p in Path("/proc").glob("[0-9]*") if _stat(int(p.name))
            and any((cwd := _cwd(int(p.name))) and (cwd == f or cwd.startswith(f + "/")) for f in folders)}


def kill_once(args: list[str], delay: float, out: Path, wait: float) -> tuple[int, list[str]]:
    """Start ``fedmech ARGS``, SIGKILL it ``delay`` s after it started its first process;
    return how many processes it had started and a description of each one alive ``wait``
    s after the kill."""
    cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[int, int] = {}
    folders: set[str] = set()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        now = descendants(proc.pid)
        if now and not seen:
            deadline = time.monotonic() + delay
        seen.update(now)
        folders.update(cwd for pid in now if (cwd := _cwd(pid)) and "/fedmech-" in cwd)
        time.sleep(0.05)
    if proc.poll() is not None:
        sys.exit(f"{' '.join(cmd)} ended (exit {proc.returncode}) before the kill at {delay:.1f} s; run it alone "
                 "to see why")
    seen.update(descendants(proc.pid))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(wait)
    alive = {pid for pid, start in seen.items() if (stat := _stat(pid)) and stat[1] == start} | in_folders(folders)
    return len(seen), [f"{pid} {_command(pid)}" for pid in sorted(alive) if _stat(pid)]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="kills of a lone fedmech run")
    parser.add_argument("--sweeps", type=int, default=3, help="kills of a fedmech sweep")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds after the kill before counting")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill moments")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    trials = [("run", RUN, rng.uniform(*RUN_KILL_S)) for _ in range(args.runs)]
    trials += [("sweep", SWEEP, rng.uniform(*SWEEP_KILL_S)) for _ in range(args.sweeps)]
    left = 0
    print(f"{'command':8} {'kill at':>8} {'started':>8} {'alive':>6}")
    with tempfile.TemporaryDirectory(prefix="orphans-") as tmp:
        for i, (what, command, delay) in enumerate(trials):
            started, alive = kill_once(command, delay, Path(tmp) / str(i), args.wait)
            left += bool(alive)
            print(f"{what:8} {delay:7.1f}s {started:8d} {len(alive):6d}" + (f"  {'; '.join(alive)}" if alive else ""),
                  flush=True)
            for pid in alive:  # leave the machine clean for the next trial
                try:
                    os.kill(int(pid.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    print(f"{left} of {len(trials)} kills left processes alive {args.wait:.0f} s later")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
