"""Errors that tell the user what was expected, what was received and what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid experiment configuration; ``where`` names the file and key."""

    def __init__(self, message: str, where: str = "") -> None:
        self.message = message
        self.where = where
        super().__init__(f"{message} in {where}" if where else message)


class DataNotFoundError(FileNotFoundError):
    """A dataset is not on disk; the message lists where we looked and how to get it."""


class BadFileError(ValueError):
    """A file is truncated, foreign or lacks what it should hold; the message names the
    file, what was expected and what to do."""


class RunFolderError(ValueError):
    """A run folder cannot be used as asked (e.g. resumed); the message says why and what
    to do instead."""
