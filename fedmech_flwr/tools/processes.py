"""Stopping what a local launch started: a process and every process below it, which may
sit in sessions of their own (the SuperLink starts the simulation, and so Ray, that way),
out of reach of killpg."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from fedmech_flwr.artifacts.liveness import process_alive


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere). The SuperLink starts
    the simulation (and so Ray) in sessions of their own, out of reach of killpg."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_processes(*procs: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop processes and everything they started (simulation, Ray, ClientApps), all at
    once: SIGTERM, then SIGKILL to whatever is still alive after ``grace_s``."""
    pids = [pid for proc in procs for pid in (proc.pid, *descendants(proc.pid))]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
            time.sleep(0.1)
        if not any(process_alive(pid) for pid in pids):
            break
    for proc in procs:
        proc.wait(timeout=10)
