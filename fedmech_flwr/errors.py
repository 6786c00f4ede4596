"""Errors that tell the user what was expected, what was received and what to do."""

from __future__ import annotations

import reprlib


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


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80
_BRIEF.maxdict = _BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = 6


def brief(value: object) -> str:
    """A repr of a value for an error message, bounded in length and depth whatever the
    value (a list that aliases expand to millions of items prints as a few)."""
    return _BRIEF.repr(value)
