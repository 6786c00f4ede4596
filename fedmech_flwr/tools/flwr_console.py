"""What a run's console shows of the ``flwr run`` stream: this project's own lines, or
(verbose) Flower's and Ray's log without the lines that are wrong or moot for a fedmech run."""

from __future__ import annotations

import re
from typing import TextIO

from fedmech_flwr.artifacts.folder import LOGS_DIR
from fedmech_flwr.foundation.safe_text import printable, strip_colours

RUN_LOG = "flwr_run"
"""``logs/flwr_run.log``: the whole stream of ``flwr run`` (Flower's, Ray's and the ServerApp's log), in ``logs/``."""
HIDDEN = re.compile("|".join([
    r"Since flwr 1\.32, default simulated SuperNodes changed",  # fedmech always sets the number
    r"To change federation size, use the following command|flwr federation simulation-config",
    r"FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator",
    r"^\s*warnings\.warn\($",  # the line under that FutureWarning
    r"fraction_evaluate is set to 0\.0\. Federated evaluation will be skipped",  # the server evaluates
]))
"""Lines of Flower's and Ray's log that are wrong or moot for a fedmech run: never shown."""
LONG_LINE = 300
"""A longer line (Flower prints the whole experiment as one) is cut on the console."""
OWN_LINE = re.compile(r"^fedmech (INFO|WARNING|ERROR): (.*)$")


class Console:
    """What a run's console shows of the ``flwr run`` stream; every line also goes, whole,
    to ``log``.

    Quiet (the default): only this project's round lines, warnings and errors, without
    their ``fedmech INFO:`` prefix. Verbose: everything but ``HIDDEN``, long lines cut.
    """

    def __init__(self, stream: TextIO, log: TextIO, verbose: bool = False) -> None:
        self.stream, self.log, self.verbose = stream, log, verbose

    def write(self, line: str) -> None:
        self.log.write(line)
        text = strip_colours(line).rstrip("\n")
        if self.verbose:
            if HIDDEN.search(text):
                return
            if len(text) > LONG_LINE:
                text = f"{text[:LONG_LINE]} ... ({len(text) - LONG_LINE} more characters in {LOGS_DIR}/{RUN_LOG}.log)"
        elif own := OWN_LINE.match(text):
            level, message = own.groups()
            if level == "INFO" and not message.startswith(("round ", "Resuming ")):
                return
            text = message if level == "INFO" else f"{level.lower()}: {message}"
        else:
            return
        self.stream.write(printable(text) + "\n")  # a run name, a plug-in's message: shown, never obeyed
        self.stream.flush()
