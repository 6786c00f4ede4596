"""Model weights as named NumPy arrays: conversion, averaging, safe files.

Files are safetensors (no pickled code is ever executed on load) and are written
atomically (:mod:`fedmech_flwr.foundation.files`), so a killed run never leaves a truncated file
behind; a file that is truncated or foreign anyway gives a ``BadFileError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from safetensors import SafetensorError
from safetensors.numpy import load, load_file, save, save_file
from torch import nn

from fedmech_flwr.foundation.errors import BadFileError
from fedmech_flwr.foundation.files import write_atomic

NamedArrays = dict[str, np.ndarray]
"""A model's (or a state's) arrays by parameter name, in the model's order."""


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

    Parameters
    ----------
    models : sequence of NamedArrays
        The models, each with the same names and shapes.
    weights : sequence of float
        One weight per model, summing to a positive number (they are normalised).

    Returns
    -------
    NamedArrays
        The mean, by name, in each array's dtype.

    Raises
    ------
    ValueError
        When the counts differ or the weights do not sum to a positive number.

    Examples
    --------
    >>> import numpy as np
    >>> weighted_mean([{"w": np.array([0.0])}, {"w": np.array([3.0])}], [2, 1])["w"]
    array([1.])
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
        out[name] = cast(acc, first.dtype)
    return out


def cast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` (computed in float64) back in an array's own ``dtype``, rounded to the
    nearest integer for an integer buffer instead of truncated."""
    return np.rint(value).astype(dtype) if np.issubdtype(dtype, np.integer) else np.asarray(value).astype(dtype)


def l2_norm(arrays: NamedArrays) -> float:
    """The L2 norm of all arrays together, as one vector (in float64)."""
    return math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in arrays.values()))


def save_arrays(path: str | Path, arrays: NamedArrays, metadata: dict[str, str] | None = None) -> None:
    """Write arrays as safetensors, atomically."""
    contiguous = {k: np.asarray(v, order="C") for k, v in arrays.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))


def load_arrays(path: str | Path, expected: Collection[str] = ()) -> NamedArrays:
    """Read a safetensors file holding at least the arrays named in ``expected``.

    A missing file raises FileNotFoundError; a truncated, foreign or incomplete one a
    ``BadFileError`` that names the file and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    try:
        arrays = load_file(str(path))
    except (SafetensorError, OSError, TypeError, ValueError) as err:
        raise BadFileError(
            f"{path} is not a readable safetensors file ({err}); it may be truncated or foreign: "
            "expected weights that fedmech wrote (checkpoints/round_NNN.safetensors, model_final.safetensors); "
            "point to one of those, or restore this file"
        ) from err
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise BadFileError(
            f"{path} lacks arrays {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} missing, "
            f"it holds {len(arrays)}); it was written for another model or by another program"
        )
    return arrays


def non_finite(arrays: NamedArrays) -> list[str]:
    """Names of the floating-point arrays holding a NaN or an infinity."""
    return [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]


def to_record(arrays: NamedArrays) -> ArrayRecord:
    """Named arrays as a Flower ArrayRecord (names and order kept), what a message carries.

    Parameters
    ----------
    arrays : NamedArrays

    Returns
    -------
    flwr.app.ArrayRecord

    Examples
    --------
    >>> import numpy as np
    >>> list(to_record({"fc.weight": np.zeros((2, 3))}))
    ['fc.weight']
    """
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def from_record(record: ArrayRecord) -> NamedArrays:
    """A Flower ArrayRecord as named NumPy arrays (the inverse of ``to_record``).

    Parameters
    ----------
    record : flwr.app.ArrayRecord

    Returns
    -------
    NamedArrays

    Examples
    --------
    >>> import numpy as np
    >>> from_record(to_record({"b": np.ones(2)}))["b"]
    array([1., 1.])
    """
    return {k: v.numpy() for k, v in record.items()}


def pack(arrays: NamedArrays) -> bytes:
    """Named arrays as safetensors bytes, for a ConfigRecord (a train reply may hold only one
    ArrayRecord: the weights)."""
    return save({k: np.asarray(v, order="C") for k, v in arrays.items()})


def unpack(data: bytes) -> NamedArrays:
    """Inverse of ``pack``: the same names, dtypes and bits (in name order)."""
    return dict(load(bytes(data)))
