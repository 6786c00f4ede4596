"""Comparing circuits, and packing them into bytes for a Flower ConfigRecord.

A mask is a dict gated-layer name -> bool vector [channels] (torch or NumPy).
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


PAPER_EMPTY_IOU = 1.0
"""The paper's code scores a layer empty in both circuits 1.0 ("they agree"); here that
convention is used only when asked for (``empty_iou: 1.0``) and is labelled wherever it is."""


def layer_iou(a: MaskLike, b: MaskLike, empty_value: float | None = None) -> dict[str, float | None]:
    """|A n B| / |A u B| per layer. A layer empty in both masks has no IoU: None (undefined),
    or ``empty_value`` when given (``PAPER_EMPTY_IOU`` reproduces the paper's code)."""
    if set(a) != set(b):
        raise ValueError(f"masks cover different layers: {sorted(a)} vs {sorted(b)}")
    out = {}
    for name in a:
        sa, sb = to_bools(a[name]), to_bools(b[name])
        if sa.shape != sb.shape:
            raise ValueError(f"layer '{name}': {sa.size} vs {sb.size} channels")
        union = np.logical_or(sa, sb).sum()
        out[name] = float(np.logical_and(sa, sb).sum() / union) if union else empty_value
    return out


def circuit_iou(a: MaskLike, b: MaskLike, empty_value: float | None = None) -> float | None:
    """Mean over layers of ``layer_iou``, undefined layers left out; None (undefined) when
    no layer has an IoU, i.e. both circuits are empty and ``empty_value`` is None."""
    values = [v for v in layer_iou(a, b, empty_value).values() if v is not None]
    return float(np.mean(values)) if values else None


def circuit_size(mask: MaskLike) -> dict[str, int]:
    """Channels in the circuit, per layer."""
    return {name: int(to_bools(values).sum()) for name, values in mask.items()}


def is_empty(mask: MaskLike) -> bool:
    """True when no layer keeps any channel."""
    return not any(circuit_size(mask).values())


def pack_masks(masks: Mapping[int, MaskLike]) -> bytes:
    """Class -> mask as compact bytes: a JSON header (classes, layer names and sizes) and
    one bit per channel, so circuits travel as a single ConfigRecord value."""
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
    given, must match what was packed: masks from another model are an error."""
    (length,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + length])
    layers: dict[str, int] = header["layers"]
    if layer_sizes is not None and dict(layers) != dict(layer_sizes):
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
