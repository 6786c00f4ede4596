"""Nothing outlives the command that started it, whatever killed that command.

Every process a launch starts (SuperLink, SuperNodes, simulation, Ray and its workers)
inherits the environment variable ``MARKER`` set to the launch's private folder. A reaper,
started beside the launch in a session of its own, waits for its parent to die; if the
folder still exists then (the parent died without cleaning up: SIGKILL, a power cut of
the CLI alone), it SIGKILLs every process carrying the marker and removes the folder.
When the parent ends normally it removes the folder itself, and the reaper exits.

    python -m fedmech_flwr.reaper OWNER_PID FOLDER
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MARKER = "FEDMECH_LAUNCH"
POLL_S = 0.1
KILL_TIMEOUT_S = 10.0


def start_reaper(folder: Path) -> subprocess.Popen:
    """Start the reaper of ``folder`` for this process (it carries no marker itself)."""
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    return subprocess.Popen([sys.executable, "-m", "fedmech_flwr.reaper", str(os.getpid()), str(folder)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def marked(folder: Path) -> list[int]:
    """The processes of this host whose environment carries ``MARKER=folder``."""
    needle = f"{MARKER}={folder}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def reap(folder: Path) -> None:
    """SIGKILL every marked process until none is left (they may still be forking), then
    remove ``folder``."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while (pids := marked(folder)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    shutil.rmtree(folder, ignore_errors=True)


def main(owner: int, folder: Path) -> None:
    while os.getppid() == owner and folder.exists():
        time.sleep(POLL_S)
    if folder.exists():
        reap(folder)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
