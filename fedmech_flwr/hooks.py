"""The diagnostics hook: the contract every diagnostic plug-in implements.

After each aggregation (every N rounds) the server hands each due diagnostic a
``RoundState``: the round number, the aggregated model, every client's model and metrics
keyed by partition-id, and named data sets. A diagnostic returns metrics (JSON-able)
and arrays; the run folder stores both. Work that needs a client's data runs in the
ClientApp (``client_side``) and travels back as a compact JSON result, which the server
side then finds in ``ClientUpdate.diagnostics``. Diagnostics only observe: they must
never change the models they are given (load copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmech_flwr.arrays import NamedArrays
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.registry import Registry

DIAGNOSTICS: Registry[type[Diagnostic]] = Registry("diagnostic")


@dataclass
class ClientUpdate:
    """What one client sent back this round."""

    partition_id: int
    arrays: NamedArrays
    num_examples: int
    metrics: dict[str, Any]
    diagnostics: dict[str, Any] = field(default_factory=dict)
    """Client-side diagnostic results, keyed by diagnostic name."""


@dataclass
class RoundState:
    """Everything a server-side diagnostic may read after one aggregation."""

    server_round: int
    global_arrays: NamedArrays
    """The aggregated model of this round."""
    previous_global_arrays: NamedArrays
    """The model the clients started this round from."""
    clients: dict[int, ClientUpdate]
    """Successful clients of this round, keyed by partition-id (ascending)."""
    datasets: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Server-held labelled data by name; ``test`` is the held-out test set."""
    num_classes: int
    build_model: Callable[[NamedArrays], FedMechModel]
    """A fresh model (eval mode, on the run's device) holding the given arrays."""
    device: torch.device


@dataclass
class ClientContext:
    """What a client-side diagnostic may read inside the ClientApp after local training."""

    server_round: int
    partition_id: int
    global_model: FedMechModel
    """The model the client received this round (a copy; do not train it)."""
    local_model: FedMechModel
    """The client's model after local training."""
    x: torch.Tensor
    y: torch.Tensor
    """The client's own training data."""
    num_classes: int
    device: torch.device


@dataclass
class DiagnosticResult:
    metrics: dict[str, Any]
    """JSON-able values, appended to metrics.jsonl."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """Arrays stored as ``diagnostics/<name>/round_<r>.safetensors``."""


class Diagnostic:
    """Base class of diagnostic plug-ins; register subclasses in ``DIAGNOSTICS``.

    The registered class is built with its validated config: ``cls(params)``.
    """

    def __init__(self, params: Any) -> None:
        self.params = params

    def client_side(self, ctx: ClientContext) -> dict[str, Any] | None:
        """Optional work on a client's own data; return a small JSON-able dict."""
        return None

    def server_side(self, state: RoundState) -> DiagnosticResult:
        raise NotImplementedError

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path) -> list[Path]:
        """Draw this diagnostic's plots from its metrics.jsonl records; return the files."""
        return []

