"""Nothing of a run outlives a SIGKILL of ``fedmech run`` or ``fedmech sweep``, at random
moments: 5 kills of a lone run and 2 of a sweep (``benchmarks/orphans.py``; its default,
10 and 3, is for a full check), nothing alive 5 s later. About 2 minutes on 2 quiet cores."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


def test_kills_of_runs_and_sweeps_at_random_moments_leave_nothing_alive():
    done = subprocess.run([sys.executable, "benchmarks/orphans.py", "--runs", "5", "--sweeps", "2", "--wait", "5"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = done.stdout.splitlines()[1:-1]
    assert len(rows) == 7 and all(int(row.split()[2]) > 0 for row in rows), done.stdout  # each kill hit a live launch
    assert rows and done.stdout.splitlines()[-1] == "0 of 7 kills left processes alive 5 s later"
