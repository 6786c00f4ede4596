"""Errors that tell the user what was expected, what was received and what to do."""

from __future__ import annotations

import re
import reprlib
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

TRACEBACK_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
"""A frame of a traceback as text (a client's error, which Flower forwards as a string)."""


class ConfigError(ValueError):
    """An invalid experiment configuration; ``where`` names the file and key.

    ``where`` ends the message's first line, so a multi-line message (a list of places
    looked in) still says on its first line what is wrong and where.
    """

    def __init__(self, message: str, where: str = "") -> None:
        self.message = message
        self.where = where
        first, newline, rest = message.partition("\n")
        super().__init__(f"{first} in {where}{newline}{rest}" if where else message)


class DataNotFoundError(FileNotFoundError):
    """A dataset is not on disk; the message lists where we looked and how to get it."""


class BadFileError(ValueError):
    """A file is truncated, foreign or lacks what it should hold; the message names the
    file, what was expected and what to do."""


class RunFolderError(ValueError):
    """A run folder cannot be used as asked (e.g. resumed); the message says why and what
    to do instead."""


class StartError(RuntimeError):
    """Flower could not be started on this machine (every port tried was taken, the
    SuperLink exited at start); the message says what was tried and where to look."""


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80
_BRIEF.maxdict = _BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = 6


def brief(value: object) -> str:
    """A repr of a value for an error message, bounded in length and depth whatever the
    value (a list that aliases expand to millions of items prints as a few)."""
    return _BRIEF.repr(value)


def shape(document: object) -> str:
    """What a document is, quoting none of it (``text of 2,841 characters``, ``a list of
    3 items``): for a whole file refused as the wrong kind, which may be anyone's (a
    sweep's ``base:`` naming /etc/passwd) and is none of the message's business."""
    if isinstance(document, str):
        return f"text of {len(document):,} characters"
    if isinstance(document, (list, dict)):
        return f"a {type(document).__name__} of {len(document):,} items"
    return f"a {type(document).__name__}"


def raised_where(frames: Iterable[tuple[str, int]]) -> str | None:
    """``module (file:line)`` of the innermost of ``frames`` ((file, line), outermost
    first) that is neither the core's nor a library's: where a plug-in or the user's own
    code raised; None when there is no such frame."""
    libraries = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    core = Path(__file__).resolve().parents[1]
    for file, line in reversed(list(frames)):
        path = Path(file).resolve()
        if path.is_file() and not path.is_relative_to(core) and not any(path.is_relative_to(p) for p in libraries):
            return f"{_module_name(path)} ({file}:{line})"
    return None


def _module_name(path: Path) -> str:
    """The dotted name ``path`` is imported by: that of the imported module with that file
    (a built-in plug-in: ``fedmech_flwr.builtin.clients.plain``), else the name from the
    deepest ``sys.path`` entry holding it."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).name == path.name and Path(file).resolve() == path:
            return name
    roots = [Path(entry or ".").resolve() for entry in sys.path]
    root = max((r for r in roots if path.is_relative_to(r)), key=lambda r: len(r.parts), default=None)
    return ".".join(path.relative_to(root).with_suffix("").parts) if root else path.stem


def raised_where_in_text(traceback_text: str) -> str | None:
    """``raised_where`` of a traceback given as text."""
    return raised_where((file, int(line)) for file, line in TRACEBACK_FRAME.findall(traceback_text))
