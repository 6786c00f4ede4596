"""The reaper: whatever kills a launch's owner, the launch's processes die with it, even
those whose environment lost the marker (Ray's agents), and no other job's process does;
nor does a test that watches a launch count another job's processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import REPO, launch_processes_of
from fedmech_flwr.artifacts.liveness import process_alive
from fedmech_flwr.tools.reaper import MARKER, launch_processes

OWNER = """
import os, pathlib, subprocess, sys, time
from fedmech_flwr.tools.reaper import MARKER, start_reaper
home = pathlib.Path(sys.argv[1]); home.mkdir()
start_reaper(home)
def start(cmd, env, cwd):  # each in a session of its own, as the SuperLink starts Ray
    return subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True).pid
pids = [
    start(["sleep", "300"], {**os.environ, MARKER: str(home)}, home),  # marked, as every launched process
    start(["sleep", "300"], {}, home),  # environment wiped (Ray's agents): its working directory is the launch's
    start([sys.executable, "-c", "import time; time.sleep(300)", str(home / "ray" / "session")], {}, "/"),  # named
    # on its command line only
]
print(*pids, flush=True)
time.sleep(300)
"""


def test_a_killed_owners_launch_dies_and_no_other_jobs_process_does(tmp_path):
    home = tmp_path / "fedmech-flwr-abc"
    other = tmp_path / "fedmech-flwr-abcd"  # another launch's folder, named with ours as a prefix
    other.mkdir()
    foreign = [subprocess.Popen(["sleep", "300"], env={**os.environ, MARKER: str(other)}, cwd=other,
                                start_new_session=True)]
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(home)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        ours = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(ours) == 3
        deadline = time.monotonic() + 5  # a child between fork and exec shows no command line yet
        while time.monotonic() < deadline and not set(ours) <= set(launch_processes(home)):
            time.sleep(0.05)
        assert set(ours) <= set(launch_processes(home))
        assert foreign[0].pid not in launch_processes(home)
        mine = launch_processes_of(owner.pid)  # what the tests that kill a real launch watch
        assert set(ours) <= mine and foreign[0].pid not in mine
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (any(process_alive(p) for p in ours) or home.exists()):
            time.sleep(0.05)
        assert [p for p in ours if process_alive(p)] == [], "processes of the killed launch are still alive"
        assert not home.exists()
        assert foreign[0].poll() is None, "the reaper killed another job's process"
    finally:
        for proc in foreign:
            proc.kill()
        for pid in launch_processes(home):
            os.kill(pid, signal.SIGKILL)
