"""What a plug-in implements and how it is found: the client and strategy bases, the
diagnostics contract (hooks), the declared outputs, the wire keys both sides
use, plug-in subcommands, the testing helpers, and the plug-in loader."""
