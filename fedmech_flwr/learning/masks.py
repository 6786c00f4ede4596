"""Circuit masks on the wire: class -> (gated layer -> bool vector of channels), packed
into bytes so that a client's circuits travel as one ConfigRecord value.

The core holds the format because both sides of the plug-in boundary read it: the
circuits diagnostic packs a client's circuits, and strategies (``circuit_masked_avg``)
read them from the train replies.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np
import torch

MaskLike = Mapping[str, torch.Tensor | np.ndarray]

_HEADER = struct.Struct("<I")
"""Byte length of the JSON header that starts a packed blob."""


def to_bools(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """A layer's mask as a flat NumPy bool array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=bool).ravel()


def pack_masks(masks: Mapping[int, MaskLike]) -> bytes:
    """Class -> mask as compact bytes: a JSON header (classes, layer names and sizes) and
    one bit per channel."""
    classes = list(masks)
    layers: dict[str, int] = {}
    if classes:
        layers = {name: to_bools(v).size for name, v in masks[classes[0]].items()}
    bits = []
    for c in classes:
        sizes = {name: to_bools(v).size for name, v in masks[c].items()}
        if sizes != layers:
            raise ValueError(f"class {c}'s mask has layers {sizes}, class {classes[0]}'s {layers}")
        bits.extend(to_bools(masks[c][name]) for name in layers)
    header = json.dumps({"classes": [int(c) for c in classes], "layers": layers}).encode()
    body = np.packbits(np.concatenate(bits)) if bits else np.zeros(0, np.uint8)
    return _HEADER.pack(len(header)) + header + body.tobytes()


def unpack_masks(
    data: bytes, layer_sizes: Mapping[str, int] | None = None
) -> dict[int, dict[str, np.ndarray]]:
    """Inverse of ``pack_masks``. ``layer_sizes`` (the model's ``gated_layers()``), when
    given, must match what was packed: masks from another model are an error (no masks
    at all match any model)."""
    (length,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + length])
    layers: dict[str, int] = header["layers"]
    if header["classes"] and layer_sizes is not None and dict(layers) != dict(layer_sizes):
        raise ValueError(f"masks were packed for layers {layers}, expected {dict(layer_sizes)}")
    per_class = sum(layers.values())
    bits = np.unpackbits(np.frombuffer(data, np.uint8, offset=_HEADER.size + length))
    needed = per_class * len(header["classes"])
    if len(bits) < needed:
        raise ValueError(f"packed masks are truncated: {len(bits)} bits for {needed} channels")
    bits = bits[:needed].astype(bool)
    out = {}
    for row, c in enumerate(header["classes"]):
        offsets = np.cumsum([0, *layers.values()]) + row * per_class
        out[c] = {name: bits[offsets[i] : offsets[i + 1]] for i, name in enumerate(layers)}
    return out
