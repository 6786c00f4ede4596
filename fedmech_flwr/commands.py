"""Extra ``fedmech`` subcommands contributed by plug-ins.

A plug-in registers a ``Command`` under its subcommand name; ``fedmech_flwr.tools.cli`` loads the
plug-ins, then adds every registered command to its parser. The core never imports the
plug-in that provides a command.

    COMMANDS.register("usae")(Command("train a universal SAE", add_arguments, run))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from fedmech_flwr.registry import Registry


@dataclass(frozen=True)
class Command:
    help: str
    """One line for ``fedmech --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's arguments to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit status. Raise ``ConfigError`` (or FileNotFoundError) for
    bad input: the CLI prints it and exits 2."""


COMMANDS: Registry[Command] = Registry("command")  # type: ignore[type-var]
