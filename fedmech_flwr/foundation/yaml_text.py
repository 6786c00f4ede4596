"""YAML that means one thing: every file and ``--set`` value the product reads goes through
``load_yaml``.

PyYAML's safe loader accepts what a config cannot mean: a key written twice (the second
block silently replaces the first whole), aliases that expand to billions of nodes (a few
lines that take minutes and gigabytes to walk or print), bytes that are not UTF-8, and
nesting deep enough to overflow Python's stack; and it refuses a raw control character (an
ESC) with a traceback. Each is a one-line ``ConfigError`` here, naming the file and the
lines, byte or character.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from fedmech_flwr.foundation.errors import ConfigError, brief
from fedmech_flwr.foundation.safe_text import printable

MAX_NODES = 100_000
"""The most nodes a document may hold with its aliases expanded (configs have hundreds)."""
MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping key written twice (a ``<<`` merge may still
    override what it merges: that is what it is for)."""

    source = ""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the safe loader refuses it below
                continue
            if earlier is not None:
                raise ConfigError(f"key {brief(key)} appears twice, on line {earlier} and on line {line}: the second "
                                  "would silently replace the first; keep one", self.source)
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _expanded_size(node: Node, sizes: dict[int, int]) -> int:
    """Nodes in ``node`` with every alias expanded, counted once per distinct node (a
    recursive alias counts as too many)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = MAX_NODES + 1  # while counting it: a cycle back to it is too many
    if isinstance(node, SequenceNode):
        size = 1 + sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, MappingNode):
        size = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    else:
        size = 1
    sizes[id(node)] = size
    return size


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document; ``source`` names it in errors (a file, ``--set``)."""
    try:
        loader = _StrictLoader(text)  # it refuses a character YAML does not allow, before parsing
    except yaml.reader.ReaderError as err:
        line = text.count("\n", 0, err.position) + 1
        column = err.position - text.rfind("\n", 0, err.position)
        raise ConfigError(f"character '{printable(chr(err.character))}' (U+{err.character:04X}) on line {line}, column "
                          f"{column} is not allowed in YAML text: remove it", source) from None
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_NODES:
            raise ConfigError(f"aliases expand to more than {MAX_NODES:,} nodes; a config needs far fewer: "
                              "write the values out, or use fewer levels of aliases", source)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse YAML: {' '.join(str(err).split())}", source) from err
    except RecursionError:
        raise ConfigError("nested too deeply to be a config (hundreds of levels)", source) from None
    finally:
        loader.dispose()


def read_yaml_file(path: str | Path) -> Any:
    """``load_yaml`` of a file, refusing bytes that are not UTF-8 (naming the offset)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"not UTF-8 text: byte {err.start} (0x{data[err.start]:02x}) cannot be decoded; "
                          "save the file as UTF-8", str(path)) from None
    return load_yaml(text, str(path))
