"""Model weights as named NumPy arrays: conversion, averaging, safe files.

Files are safetensors (no pickled code is ever executed on load) and are written
atomically (write to a temporary name, then rename), so a killed run never leaves a
truncated file behind.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from torch import nn

NamedArrays = dict[str, np.ndarray]


def model_arrays(model: nn.Module) -> NamedArrays:
    """The model's state_dict as CPU NumPy arrays (same names, same order)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_model_arrays(model: nn.Module, arrays: NamedArrays) -> None:
    """Load named arrays into ``model`` (strict: names and shapes must match)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, order="C")) for k, v in arrays.items()})


def weighted_mean(models: Sequence[NamedArrays], weights: Sequence[float]) -> NamedArrays:
    """Weighted mean of several models' arrays, computed in float64 in the given order.

    Each array keeps its dtype: integer buffers (e.g. BatchNorm's ``num_batches_tracked``)
    are rounded back to integers instead of silently becoming float64.
    """
    if not models or len(models) != len(weights):
        raise ValueError(f"need one weight per model, got {len(models)} models and {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    out: NamedArrays = {}
    for name, first in models[0].items():
        acc = np.zeros(first.shape, dtype=np.float64)
        for arrays, w in zip(models, weights):
            acc += arrays[name].astype(np.float64) * (w / total)
        out[name] = np.rint(acc).astype(first.dtype) if np.issubdtype(first.dtype, np.integer) else acc.astype(first.dtype)
    return out


def save_arrays(path: str | Path, arrays: NamedArrays, metadata: dict[str, str] | None = None) -> None:
    """Write arrays as safetensors, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: np.asarray(v, order="C") for k, v in arrays.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def load_arrays(path: str | Path) -> NamedArrays:
    """Read a safetensors file; a missing, truncated or foreign file gives a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); it may be truncated or foreign") from err


def to_record(arrays: NamedArrays) -> ArrayRecord:
    """Named arrays as a Flower ArrayRecord (names and order kept)."""
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def from_record(record: ArrayRecord) -> NamedArrays:
    """A Flower ArrayRecord as named NumPy arrays."""
    return {k: v.numpy() for k, v in record.items()}
