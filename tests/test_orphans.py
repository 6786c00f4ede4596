"""Nothing of a run outlives a SIGKILL of ``fedmech run`` or ``fedmech sweep``, at random
moments: 10 kills of a lone run and 3 of a sweep (``benchmarks/orphans.py``), nothing
alive 5 s later. About 4 minutes on 2 cores."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


def test_ten_kills_of_a_run_and_three_of_a_sweep_leave_nothing_alive():
    done = subprocess.run([sys.executable, "benchmarks/orphans.py", "--runs", "10", "--sweeps", "3", "--wait", "5"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = done.stdout.splitlines()[1:-1]
    assert len(rows) == 13 and all(int(row.split()[2]) > 0 for row in rows), done.stdout  # each kill hit a live launch
    assert rows and done.stdout.splitlines()[-1] == "0 of 13 kills left processes alive 5 s later"
