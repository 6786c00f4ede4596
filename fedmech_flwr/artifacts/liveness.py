"""Whether the process a lock file or a status.json names still runs: the one liveness rule
every reader and writer of run and sweep folders applies (pid, host and the process's
start, so a reused pid reads as another process), and the folder lock built on it."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmech_flwr.foundation.errors import BadFileError, RunFolderError

log = logging.getLogger(__name__)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22):
    with the pid, it names one process, so a pid the system reused reads as another one.
    None where it cannot be read (no such process, no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def this_process() -> dict[str, Any]:
    """What a lock or status.json records of the process writing it: pid, host and start."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid())}


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, exited but not yet reaped, does not)."""
    if pid <= 0:  # os.kill would address a process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # it exited just now, or there is no /proc (not Linux)
        return not Path("/proc").is_dir()


@dataclass(frozen=True)
class Writer:
    """The process a lock file or a status.json names, and what this host can tell of it:
    the one liveness rule every reader and writer of run and sweep folders applies."""

    pid: Any
    host: Any
    since: str | None
    state: str
    """``alive`` (on this host, and running), ``gone`` (on this host, and ended) or
    ``elsewhere`` (on another host, whose processes this host cannot see: neither alive
    nor gone as far as this host can tell, as in a folder copied from another machine or
    on a disk two machines share)."""
    start: Any = None
    """The process's start (``process_start``), where recorded."""

    @property
    def where(self) -> str:
        """``pid 12 on HOST``; ``on HOST (pid 12), not checked from here`` for another host's."""
        if self.state == "elsewhere":
            return f"on {self.host} (pid {self.pid}), not checked from here"
        return f"pid {self.pid} on {self.host}"


def writer_of(doc: dict[str, Any] | None) -> Writer | None:
    """The writer a lock's or a status.json's ``pid`` and ``host`` name (None when they
    name none): alive or gone when it ran on this host, ``elsewhere`` when on another."""
    if not doc or ("pid" not in doc and "host" not in doc):
        return None
    pid, host, start = doc.get("pid"), doc.get("host"), doc.get("start")
    if host != socket.gethostname():
        state = "elsewhere"
    elif not isinstance(pid, int) or not process_alive(pid):
        state = "gone"
    else:  # the same pid, and (where recorded) the same start: the pid was not reused
        state = "alive" if start is None or process_start(pid) in (start, None) else "gone"
    return Writer(pid, host, doc.get("since"), state, start)


def lock_writer(lock_file: Path) -> Writer | None:
    """The writer ``lock_file`` names; None when there is no lock (or an empty one)."""
    try:
        text = lock_file.read_text()
    except FileNotFoundError:  # no lock, or one released just now
        return None
    try:
        doc = json.loads(text or "{}")
    except ValueError as err:
        raise BadFileError(f"{lock_file} is not JSON ({err}); the file was damaged: delete it if no process "
                           "runs that folder") from None
    return writer_of(doc if isinstance(doc, dict) else None)


def live_holder(lock_file: Path) -> dict[str, Any] | None:
    """The live process (pid, host, since) that holds ``lock_file``, or None: no lock, or
    one whose writer is not alive on this host (``writer_of``)."""
    writer = lock_writer(lock_file)
    if writer is None or writer.state != "alive":
        return None
    return {"pid": writer.pid, "host": writer.host, "since": writer.since, "start": writer.start}


class FolderLock:
    """A lock file that keeps a folder to one process: it names this process (pid, host,
    since) and goes when the ``with`` block ends; a stale lock (``live_holder``) is taken
    over (one of another host, which this host cannot check, with a warning). A live
    holder is a ``RunFolderError`` that ends with ``then``: what to do once
    the holder is gone. A folder the lock had to create, and nothing else wrote into, is
    removed with it."""

    def __init__(self, path: Path, then: str) -> None:
        self.path = path
        self.then = then
        self.made_folder = False

    def __enter__(self) -> FolderLock:
        folder = self.path.parent
        self.made_folder = not folder.exists()
        mine = folder / f".tmp.{self.path.name}.{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            mine.write_text(json.dumps({**this_process(),
                                        "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))
        except OSError as err:
            raise RunFolderError(f"cannot write in {folder} ({err.strerror or err}); choose another --out") from None
        try:
            os.link(mine, self.path)  # fails if the lock exists: of two starters, only one gets it
        except FileExistsError:
            writer = lock_writer(self.path)
            if writer and writer.state == "alive":
                raise RunFolderError(f"{folder} is being run by process {writer.pid} (since "
                                     f"{writer.since}); wait for it or stop it, then {self.then}") from None
            if writer and writer.state == "elsewhere":  # its process cannot be seen from here
                log.warning("taking over %s, held by a process %s (since %s): make sure it no longer runs",
                            self.path, writer.where, writer.since)
            os.replace(mine, self.path)  # a stale lock
        finally:
            mine.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)
        if self.made_folder and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()



def writer_gone(status: dict[str, Any]) -> bool:
    """Whether a status.json says running while the process that wrote it is gone from
    this host (``writer_of``: another host's processes cannot be seen from here, never gone)."""
    return status["status"] == "running" and (writer := writer_of(status)) is not None and writer.state == "gone"


def writer_alive(status: dict[str, Any]) -> bool:
    """Whether a status.json says running and the process that wrote it runs on this host."""
    return status["status"] == "running" and (writer := writer_of(status)) is not None and writer.state == "alive"
