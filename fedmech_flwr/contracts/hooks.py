"""The diagnostics hook: the contract every diagnostic plug-in implements.

After each aggregation (every N rounds) the server hands each due diagnostic a
``RoundState``: the round number, the aggregated model, every client's model and metrics
keyed by partition-id, and named data sets. A diagnostic returns metrics (JSON-able)
and arrays; the run folder stores both.

Work that needs a client's data runs in the ClientApp, in two places:

- ``client_side(ClientContext)`` right after local training (the received and the
  trained model); its result arrives in ``ClientUpdate.diagnostics[name]``;
- ``client_side_global(GlobalContext)`` on the *new* aggregated model, in a
  ``query.diagnose`` round trip the server makes after aggregation, only for diagnostics
  that override it; its result arrives in ``ClientUpdate.global_diagnostics[name]``.

Results are small dicts of JSON-able values and ``bytes`` (e.g. packed masks), carried in
a ConfigRecord (bytes stay bytes). Diagnostics only observe: they must never change the
models they are given. One that keeps state across rounds (e.g. each client's previous
circuits) implements ``Resumable`` so that a resumed run restores it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedmech_flwr.foundation.registry import Registry
from fedmech_flwr.learning.arrays import NamedArrays
from fedmech_flwr.models import FedMechModel

DIAGNOSTICS: Registry[type[Diagnostic]] = Registry("diagnostic")


@runtime_checkable
class Resumable(Protocol):
    """A strategy or diagnostic that keeps state across rounds (server momentum, a
    client's previous circuits). Without this a resumed run would start that state
    afresh and drift from an uninterrupted one. ``state_arrays`` is saved with every
    round's resume point; ``load_state_arrays`` gets it back when a killed run resumes."""

    def state_arrays(self) -> NamedArrays: ...

    def load_state_arrays(self, arrays: NamedArrays) -> None: ...


@dataclass
class ClientUpdate:
    """What one client sent back this round."""

    partition_id: int
    arrays: NamedArrays
    num_examples: int
    metrics: dict[str, Any]
    diagnostics: dict[str, Any] = field(default_factory=dict)
    """``client_side`` results (after local training), keyed by diagnostic name."""
    global_diagnostics: dict[str, Any] = field(default_factory=dict)
    """``client_side_global`` results (on this round's aggregate), keyed by name."""
    state: NamedArrays = field(default_factory=dict)
    """The client's own state after this round (``FedMechClient.state``); empty for most."""


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
    """Server-held labelled data by name: ``test`` (the test set); when the config names one
    (``data.audit_per_class``), ``audit`` (held out from every client); and, for a
    diagnostic whose ``needs_pooled_data`` says so, ``pooled`` (every client's training
    shard, which only a simulation's server holds)."""
    num_classes: int
    build_model: Callable[[NamedArrays], FedMechModel]
    """A fresh model (eval mode, on the run's device) holding the given arrays."""
    device: torch.device
    seed: int
    """The experiment's seed: derive every random choice with ``fedmech_flwr.foundation.seeds.seed_for``
    from it, a named purpose and the round."""


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
    seed: int
    """The experiment's seed, for ``fedmech_flwr.foundation.seeds.seed_for`` with the partition and
    round."""


@dataclass
class GlobalContext:
    """What ``client_side_global`` may read: the new aggregate and the client's own data."""

    server_round: int
    partition_id: int
    global_model: FedMechModel
    """This round's aggregated model, as the server will send it next round."""
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    device: torch.device
    seed: int
    """The experiment's seed, for ``fedmech_flwr.foundation.seeds.seed_for`` with the partition and
    round."""


@dataclass
class DiagnosticResult:
    """What a diagnostic returns each round: its metrics (keyed as its ``Outputs`` declares
    them) and, optionally, arrays to keep.

    Parameters
    ----------
    metrics : dict
        JSON-able values, appended to ``metrics.jsonl``.
    arrays : dict of str to numpy.ndarray
        Stored as ``diagnostics/<name>/round_<r>.safetensors``.

    Examples
    --------
    >>> DiagnosticResult({"global_norm": 3.2}).metrics
    {'global_norm': 3.2}
    """

    metrics: dict[str, Any]
    """JSON-able values, appended to metrics.jsonl."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """Arrays stored as ``diagnostics/<name>/round_<r>.safetensors``."""


class Diagnostic:
    """Base class of diagnostic plug-ins; register subclasses in ``DIAGNOSTICS``.

    The registered class is built with its validated config: ``cls(params)``. Rules
    between its parameters and the experiment or the data belong in the ``check`` it
    registers with (``fedmech_flwr.foundation.registry.Entry.check``): they then fail at validation.
    """

    def __init__(self, params: Any) -> None:
        self.params = params

    def client_side(self, ctx: ClientContext) -> dict[str, Any] | None:
        """Optional work on a client's own data after its local training, inside the ClientApp:
        its small result reaches ``server_side`` in ``state.clients[i]``.

        Parameters
        ----------
        ctx : ClientContext
            The client's data, its trained model, the round.

        Returns
        -------
        dict or None
            A small, JSON-able dict (None: nothing).

        Examples
        --------
        >>> class LabelCount(Diagnostic):
        ...     def client_side(self, ctx):
        ...         return {"labels": int(ctx.y.unique().numel())}
        """
        return None

    def client_side_global(self, ctx: GlobalContext) -> dict[str, Any] | None:
        """Optional work on the new aggregate with a client's own data; a small dict."""
        return None

    def needs_global_pass(self) -> bool:
        """Whether this diagnostic asks for the post-aggregation client round trip."""
        return type(self).client_side_global is not Diagnostic.client_side_global

    def needs_pooled_data(self) -> bool:
        """Whether ``server_side`` reads ``RoundState.datasets["pooled"]``: every client's
        training shard pooled, a simulation-only oracle (no real federation's server holds
        its clients' data)."""
        return False

    def server_side(self, state: RoundState) -> DiagnosticResult:
        """What a diagnostic measures on the server after each aggregation it runs in: every
        diagnostic implements it.

        Parameters
        ----------
        state : RoundState
            The round: the new and the previous global model, the clients' updates, what
            ``client_side`` returned for each.

        Returns
        -------
        DiagnosticResult
            Its metrics (keyed as its ``Outputs`` declares them) and arrays to keep.

        Examples
        --------
        >>> class Clients(Diagnostic):
        ...     def server_side(self, state):
        ...         return DiagnosticResult({"clients": len(state.clients)})
        """
        raise NotImplementedError

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        """Draw this diagnostic's plots from its metrics.jsonl records; return the files.
        ``class_names`` label per-class rows (the dataset's names, as partitions.json has them).
        Import what draws (``fedmech_flwr.artifacts.plotting``, matplotlib) in here: every ClientApp
        imports the plug-ins and never draws."""
        return []


_JSON_KEY = "json"
_BYTES_PREFIX = "bytes:"


def encode_results(results: dict[str, dict[str, Any]]) -> dict[str, str | bytes]:
    """Client-side results by diagnostic name as ConfigRecord entries (bytes kept raw)."""
    entries: dict[str, str | bytes] = {}
    plain: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        plain[name] = {}
        for key, value in result.items():
            if isinstance(value, bytes):
                entries[f"{_BYTES_PREFIX}{name}:{key}"] = value
            else:
                plain[name][key] = value
    entries[_JSON_KEY] = json.dumps(plain)
    return entries


def decode_results(record: ConfigRecord) -> dict[str, dict[str, Any]]:
    """Inverse of ``encode_results``."""
    results: dict[str, dict[str, Any]] = json.loads(str(record.get(_JSON_KEY, "{}")))
    for key, value in record.items():
        if key.startswith(_BYTES_PREFIX):
            name, item = key[len(_BYTES_PREFIX):].split(":", 1)
            results.setdefault(name, {})[item] = bytes(value)
    return results
