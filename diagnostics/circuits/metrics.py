"""Comparing circuits.

A mask is a dict gated-layer name -> bool vector [channels] (torch or NumPy); how masks
travel between clients and server is :mod:`fedmech_flwr.learning.masks`.
"""

from __future__ import annotations

import numpy as np

from fedmech_flwr.api._builtin import MaskLike, to_bools

PAPER_EMPTY_IOU = 1.0
"""The paper's code scores a layer empty in both circuits 1.0 ("they agree"); here that
convention is used only when asked for (``empty_iou: 1.0``) and is labelled wherever it is."""
IOU_KEYS = ("intra_client", "inter_client", "local_to_global", "inter_class_local", "inter_class_global")
"""The IoUs a round records: between clients' circuits of a class, between a client's and the
global model's, and between classes' circuits of one model."""


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


def empty_iou_convention(empty_iou: float | None) -> str:
    """How an IoU of two empty layers was scored, for plot titles and logs."""
    if empty_iou is None:
        return "empty vs empty: undefined, left out of means"
    if empty_iou == PAPER_EMPTY_IOU:
        return f"empty vs empty scored {empty_iou:g} (empty_iou: the paper's convention)"
    return f"empty vs empty scored {empty_iou:g} (empty_iou)"
