"""What a command plug-in (a ``fedmech NAME`` subcommand) needs: its registry, the command
and its help.

Examples
--------
>>> from fedmech_flwr.api.command import COMMANDS, Command, Help
>>> hello = Command(Help("say hello", "Print hello.", ("0  said",), ("fedmech hello", "fedmech hello --help")),
...                 add_arguments=lambda parser: None, run=lambda args: print("hello") or 0)
>>> _ = COMMANDS.register("hello")(hello)
"""

from __future__ import annotations

from fedmech_flwr.contracts.commands import COMMANDS, Command, Help

__all__ = ["COMMANDS", "Command", "Help"]
