"""Text that leaves the program is safe where it lands: a terminal, a spreadsheet, a page.

Names of folders, runs and classes, a run's error and a plug-in's metric keys come from
files anyone may have written. Printed raw, an ESC sequence retitles or rewrites the
terminal, a newline forges a line of output and a bidi override reverses what follows;
exported raw, a CSV cell that begins with ``=`` is a formula a spreadsheet runs (OWASP,
CSV injection).
"""

from __future__ import annotations

import logging
import re
from typing import Any

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
"""What a terminal, or a reader's eye, takes for an instruction rather than a character:
C0 (tab and newline too), DEL, C1, and the Unicode bidi embeddings, overrides and
isolates; and the lone surrogates that stand for a file name's bytes that are not UTF-8,
which no UTF-8 stream can print."""

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
"""A cell a spreadsheet reads as a formula when it begins with one of these (OWASP)."""
ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
"""A terminal colour (or other CSI) code, as Ray puts in the tracebacks it forwards."""


def _escape(match: re.Match) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def printable(text: str) -> str:
    """``text`` with each control character written as its escape (``\\x1b``, ``\\n``,
    ``\\u202e``), as Python writes them: one line that shows what it holds, for the
    console, ``fedmech status`` and the report."""
    return CONTROL.sub(_escape, text)


def printable_lines(text: str) -> str:
    """``text`` with each of its lines ``printable``: a message of several lines (the
    places a dataset was looked for, a log's tail) keeps them, and nothing in them can act
    on the terminal."""
    return "\n".join(map(printable, text.split("\n")))


class PrintableFormatter(logging.Formatter):
    """A log line formatter whose lines are ``printable_lines``: a plug-in's or a file's
    text in a log message is shown, never obeyed."""

    def format(self, record: logging.LogRecord) -> str:
        return printable_lines(super().format(record))


def csv_cell(value: Any) -> Any:
    """A cell a spreadsheet (or ``cat``) shows as the text it is: a string ``printable``,
    with a leading ``'`` where it begins as a formula; anything else (a number, negative
    ones too) is left as it is."""
    if not isinstance(value, str):
        return value
    text = printable(value)
    return f"'{text}" if text.startswith(FORMULA_START) else text


def strip_colours(text: str) -> str:
    return ANSI_ESCAPE.sub("", text)
