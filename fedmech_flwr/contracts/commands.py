"""Extra ``fedmech`` subcommands contributed by plug-ins.

A plug-in registers a ``Command`` under its subcommand name; ``fedmech_flwr.tools.cli`` loads the
plug-ins, then adds every registered command to its parser. The core never imports the
plug-in that provides a command. A command's ``Help`` is what the built-in ones have:

    COMMANDS.register("usae")(Command(Help("train a universal SAE", "Train ...", ("0  written", "2  bad input"),
                                           ("fedmech usae RUN_A RUN_B --layer conv3", "...")), add_arguments, run))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from fedmech_flwr.foundation.registry import Registry


@dataclass(frozen=True)
class Help:
    """A subcommand's help: one line for ``fedmech --help``; a paragraph, its exit codes
    and two examples for ``fedmech NAME --help``."""

    line: str
    paragraph: str
    exits: tuple[str, ...]
    """``"0  what exit 0 means"``, one per code."""
    examples: tuple[str, str]


@dataclass(frozen=True)
class Command:
    """A ``fedmech NAME`` subcommand of a plug-in, registered with
    ``COMMANDS.register(NAME)(Command(...))``.

    Parameters
    ----------
    help : Help
        Its help texts.
    add_arguments : callable
        Adds its arguments to its ``argparse`` parser.
    run : callable
        Runs it with the parsed arguments; returns the exit status.

    Examples
    --------
    >>> hello = Command(Help("say hello", "Print hello.", ("0  said",), ("fedmech hello", "fedmech hello --help")),
    ...                 add_arguments=lambda parser: None, run=lambda args: print("hello") or 0)
    """

    help: Help
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's arguments to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit status. Raise ``ConfigError`` (or FileNotFoundError) for
    bad input: the CLI prints it and exits 2."""


COMMANDS: Registry[Command] = Registry("command")  # type: ignore[type-var]
