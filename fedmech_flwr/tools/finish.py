"""How a run that ``fedmech`` launched ends: its status is written last, and tells the truth.

The ServerApp writes what the rounds leave (final model, plots, event files), then hands
the status to the ``fedmech`` process that holds the run's lock (``RunFolder.hand_over``).
That process, once Flower has stopped and the logs are kept, writes the run's page
(``fedmech run`` and ``deploy-local``; a sweep writes one page for all its cells) and
only then marks the run completed (``finish_run``). An output it cannot write fails the
run, resumable, with one line; ``fedmech run --resume`` then finishes what is missing
without running a round again. Ctrl-C, SIGTERM and SIGHUP leave the run interrupted
(``interrupt_run``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.folder import APP_DIR, RunFolder, read_status, settle_status
from fedmech_flwr.artifacts.liveness import writer_of
from fedmech_flwr.foundation.errors import BadFileError, ConfigError

log = logging.getLogger(__name__)

PAGE_DIR = "report"
"""Where a run's or sweep's page goes, inside its folder: ``report/index.html``."""
PAPER_VALUES = APP_DIR / "experiments" / "paper" / "values.yaml"
"""The published values a page shows beside matching groups (``fedmech report --paper``)."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP (a scheduler, ``timeout``, ``docker stop``, a closed
    terminal), a ``KeyboardInterrupt`` so that each unwinds as Ctrl-C always did: every
    process the command started is stopped, and the run says how to continue. ``at``: when
    it came (``interrupt_run`` reads a status written after it as the stop's doing)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.at = time.time()


def exit_code(stop: KeyboardInterrupt) -> int:
    """The shell's code for a command a signal stopped: 130 (Ctrl-C), 143 (SIGTERM), 129 (SIGHUP)."""
    return 128 + getattr(stop, "signum", signal.SIGINT)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """In this block, Ctrl-C, SIGTERM and SIGHUP raise ``Stopped``; a second one, while the
    first unwinds, is ignored so that the cleanup ends. The handlers in place before come back
    after the block (a test's process keeps its own). Only the main thread can set them:
    elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def stop(signum: int, _frame: Any) -> None:
        for s in caught:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in caught}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class OutputError(OSError):
    """An output of the run's end (its logs, its page) that could not be written."""


def output_failure(what: str, err: Exception) -> str:
    """One line: which output, the file, and why (``could not write the page
    (/runs/x/report/index.html: No space left on device)``)."""
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"could not write {what} ({where}{err.strerror})"
    return f"could not write {what} ({' '.join(str(err).split())})"


def _handed_to_me(status: dict[str, Any]) -> bool:
    """Whether the ServerApp left this run's end to this process (``RunFolder.hand_over``)."""
    writer = writer_of(status)
    return bool(status["status"] == "running" and status.get("finishing") and writer and writer.state == "alive"
                and writer.pid == os.getpid())


def finish_run(run_dir: Path, flower_status: str, logs_error: str | None = None, *,
               page: bool) -> tuple[dict[str, Any], str]:
    """The run's end, once Flower has stopped and ``launch`` kept the logs (``logs_error``:
    why it could not): a run the ServerApp handed over gets its page (``page``), and only
    then "completed"; an output that cannot be written leaves it failed and resumable,
    with one line. A run whose ServerApp died is settled (``settle_status``). Returns the
    final status.json and the words naming the page (``write_page``; "" without one)."""
    status = read_status(run_dir)
    if _handed_to_me(status):
        folder = RunFolder(run_dir)
        try:
            if logs_error:
                raise OutputError(logs_error)
            words = write_page([run_dir], run_dir, strict=True) if page else ""
            folder.set_status("completed")
            return read_status(run_dir), words
        except (OSError, ConfigError, BadFileError) as err:
            reason = str(err) if isinstance(err, OutputError) else output_failure("the run's page", err)
            folder.record_end("failed", f"after the last round, {reason}", True)
    elif logs_error:
        log.warning("%s", logs_error)
    status = settle_status(run_dir, flower_status)
    return status, write_page([run_dir], run_dir) if page and status["status"] != "missing" else ""


def interrupt_run(run_dir: Path, stop: KeyboardInterrupt) -> None:
    """Once every process the run started is stopped: a run still "running" (its ServerApp
    stopped before it could say so), or failed after the stop came (the clients' actors
    stopped first, and the ServerApp recorded their loss), is marked interrupted,
    resumable, naming the signal. A failure recorded before the stop stays."""
    status = read_status(run_dir)
    at = getattr(stop, "at", None)
    written = status.get("updated_at")  # none in a status.json mended by hand
    failed_by_the_stop = (status["status"] == "failed" and at is not None and written is not None
                          and dt.datetime.fromisoformat(written).timestamp() >= at)
    if status["status"] != "running" and not failed_by_the_stop:
        return
    signum = getattr(stop, "signum", signal.SIGINT)
    RunFolder(run_dir).record_end("interrupted", f"stopped by {signal.Signals(signum).name}", True)


def write_page(paths: list[Path], folder: Path, *, strict: bool = False) -> str:
    """Write the page of a run or sweep folder (``fedmech report`` of it, into
    ``folder/report``) and return the words that name it for the console's last line. A
    page that cannot be written is said so; ``strict`` (a run's end, where the page is one
    of the run's outputs) raises instead."""
    from fedmech_flwr.tools.report import write_report

    try:
        return f"page: {write_report(paths, folder / PAGE_DIR, PAPER_VALUES)}"
    except (ConfigError, BadFileError, OSError) as err:
        if strict:
            raise
        return f"no page ({' '.join(str(err).split())}; `fedmech report {folder} --out {folder / PAGE_DIR}` retries it)"
