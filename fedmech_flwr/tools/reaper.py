"""Nothing outlives the command that started it, whatever killed that command.

Every process a launch starts (SuperLink, SuperNodes, simulation, Ray and its workers)
runs in the launch's private folder: its working directory is there, and it inherits the
environment variable ``MARKER`` set to that folder. Ray rewrites its agents' environment
block (their process title overwrites it), so the marker alone misses them; the folder
also shows in their working directory and in the paths Ray passes them (``RAY_TMPDIR``,
``--session-dir``). A process is the launch's if the folder appears in any of the three.

A reaper, started beside the launch in a session of its own, waits for its parent to
die; if the folder still exists then (the parent died without cleaning up: SIGKILL, a
power cut of the CLI alone), it SIGKILLs every process of the launch and removes the
folder. When the parent ends normally it removes the folder itself, and the reaper exits.

    python -m fedmech_flwr.tools.reaper OWNER_PID FOLDER
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MARKER = "FEDMECH_LAUNCH"
POLL_S = 0.1
KILL_TIMEOUT_S = 10.0
DELETED = " (deleted)"
"""What Linux appends to a ``/proc/PID/cwd`` link whose folder was removed."""


def start_reaper(folder: Path) -> subprocess.Popen:
    """Start the reaper of ``folder`` for this process (it carries no marker itself)."""
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    return subprocess.Popen([sys.executable, "-m", "fedmech_flwr.tools.reaper", str(os.getpid()), str(folder)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _names_folder(folder: Path) -> re.Pattern[bytes]:
    """``folder`` as a whole path in a NUL-, space- or colon-separated byte string (an
    environment block, a command line, a PYTHONPATH), not as a prefix of another name."""
    return re.compile(re.escape(os.fsencode(folder)) + rb"(?=[/\0 :=]|$)")


def launch_processes(folder: Path) -> list[int]:
    """The processes of this host that belong to the launch of ``folder``: their working
    directory is in it, or their environment or command line names it. The reaper itself
    (which is given the folder) is left out."""
    names = _names_folder(folder)
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd").removesuffix(DELETED)
            mine = (Path(cwd).is_relative_to(folder) or names.search((proc / "environ").read_bytes()) is not None
                    or names.search((proc / "cmdline").read_bytes()) is not None)
        except OSError:  # gone, or not ours to read
            continue
        if mine:
            found.append(pid)
    return found


def kill_launch(folder: Path) -> None:
    """SIGKILL every process of the launch until none is left (they may still be forking)."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while (pids := launch_processes(folder)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def reap(folder: Path) -> None:
    """Kill the launch of ``folder``, then remove the folder."""
    kill_launch(folder)
    shutil.rmtree(folder, ignore_errors=True)


def main(owner: int, folder: Path) -> None:
    while os.getppid() == owner and folder.exists():
        time.sleep(POLL_S)
    if folder.exists():
        reap(folder)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
