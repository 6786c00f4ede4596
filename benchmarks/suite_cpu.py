"""Where the test suite's CPU goes: the CPU-seconds each test used, with every process it
started (Flower, Ray, the launches' children), whichever pytest-xdist worker ran it. Under
``make test`` (four workers on 2 cores) a test's wall time depends on the tests beside
it far more than its CPU-seconds do, so these say which tests to make cheaper.

As a pytest plug-in it puts each worker in its own cgroup-v1 ``cpuacct`` group and writes one
line per test to ``SUITE_CPU_OUT`` (a folder); as a script it sums those lines. ``make
test``'s command with the plug-in, its paths absolute because some tests run from other
folders, and ``-p`` on the command line, not in ``PYTEST_ADDOPTS``, which the tests that
run pytest themselves (the tutorial's, ``fedmech new``'s) would pass on:

    PYTHONPATH=$PWD/benchmarks SUITE_CPU_OUT=$PWD/build/suite-cpu \
        .venv/bin/python -m pytest -q -n 4 --dist worksteal -p suite_cpu
    .venv/bin/python benchmarks/suite_cpu.py build/suite-cpu

It needs a writable ``/sys/fs/cgroup/cpuacct`` (root on a cgroup-v1 machine, as this
project's CI machine is); elsewhere the plug-in refuses to start, naming it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _group() -> Path:
    return CPUACCT / f"fedmech-tests-{_worker()}-{os.getpid()}"


def _out() -> Path:
    return Path(os.environ.get("SUITE_CPU_OUT", "build/suite-cpu"))


def pytest_configure(config) -> None:
    try:
        _group().mkdir(exist_ok=True)
        (_group() / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as err:
        raise pytest.UsageError(f"suite_cpu needs a writable {CPUACCT} (cgroup v1, as root): {err}") from err
    _out().mkdir(parents=True, exist_ok=True)


def pytest_unconfigure(config) -> None:
    """Leave the group (back to the root group) and remove it once no process is left in it."""
    try:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        _group().rmdir()
    except OSError:
        pass  # never made, or a process the tests started still runs in it (it goes with the next reboot)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    usage = _group() / "cpuacct.usage"
    before = int(usage.read_text())
    yield
    line = {"test": item.nodeid, "cpu_s": (int(usage.read_text()) - before) / 1e9,
            "integration": item.get_closest_marker("integration") is not None, "ended": time.time()}
    with open(_out() / f"{_worker()}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")


def summary(folder: Path, top: int = 20) -> str:
    """The total, its integration tests' share, how long before the suite's end each worker
    ran out of tests (the end the cores spent on fewer tests), and the ``top`` tests by
    CPU-seconds."""
    rows = [dict(json.loads(line), worker=path.stem) for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text().splitlines()]
    if not rows:
        raise SystemExit(f"no test lines in {folder}: run the suite with the plug-in first (see its docstring)")
    total = sum(r["cpu_s"] for r in rows)
    integration = sum(r["cpu_s"] for r in rows if r["integration"])
    lines = [f"{len(rows)} tests, {total:.0f} CPU-s; integration tests "
             f"({sum(r['integration'] for r in rows)}) {integration:.0f} CPU-s ({integration / total:.0%})"]
    ended: dict[str, float] = {}
    for r in rows:
        ended[r["worker"]] = max(ended.get(r["worker"], r["ended"]), r["ended"])
    last = max(ended.values())
    lines.append("each worker's last test ended before the suite's last: "
                 + ", ".join(f"{worker} {last - end:.0f} s" for worker, end in sorted(ended.items())))
    lines += [f"{r['cpu_s']:8.1f}  {r['test']}" for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "build/suite-cpu")))
