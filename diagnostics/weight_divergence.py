"""How far each client's model drifts from the aggregate, layer by layer.

Per client i, with w_i its trained weights, g the new global model and p the model the
round started from (only the prunable weight tensors of the model interface):

- ``relative_distance``  = ||w_i - g|| / ||g||        (whole model and per layer)
- ``update_cosine``      = cos(w_i - p, g - p)          (does the client pull with the average?)
- ``support_iou``        = |supp(w_i) n supp(g)| / |supp(w_i) u supp(g)|  (non-zero weights,
  mean over layers; 1 when both are empty), which shows how much of the sparse masks
  the clients share after averaging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, RoundState


@dataclass
class WeightDivergenceConfig:
    per_layer: bool = True
    """Also report every metric per layer (bigger records)."""


def _norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.square(x, dtype=np.float64))))


def _cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    na, nb = _norm(a), _norm(b)
    return float(np.dot(a.ravel().astype(np.float64), b.ravel().astype(np.float64)) / (na * nb)) if na and nb else None


def support_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of the non-zero entries of two arrays; two empty supports give 1.0."""
    sa, sb = a != 0, b != 0
    union = np.logical_or(sa, sb).sum()
    return float(np.logical_and(sa, sb).sum() / union) if union else 1.0


OUTPUTS = Outputs("Client drift (weight_divergence diagnostic)", {
    "mean.relative_distance": Metric("client drift ||w_i - g|| / ||g||", ("mean", "relative_distance"), "ratio", 3,
                                     better="lower"),
    "mean.update_cosine": Metric("cos(client update, global update)", ("mean", "update_cosine"), "cosine", 3,
                                 better="higher"),
    "mean.support_iou": Metric("non-zero support IoU, client vs global", ("mean", "support_iou"), "IoU", 2),
}, curves=("mean.relative_distance", "mean.update_cosine"), headline=("mean.update_cosine",))
"""The means over the round's clients."""


@DIAGNOSTICS.register("weight_divergence", WeightDivergenceConfig, outputs=OUTPUTS)
class WeightDivergence(Diagnostic):
    """Per-client drift from the global model, update alignment and mask overlap."""

    def server_side(self, state: RoundState) -> DiagnosticResult:
        layers = list(state.build_model(state.global_arrays).prunable_parameters())
        g = state.global_arrays
        p = state.previous_global_arrays
        flat = lambda arrays: np.concatenate([arrays[k].ravel() for k in layers]).astype(np.float64)  # noqa: E731
        g_flat, step = flat(g), flat(g) - flat(p)
        clients: dict[str, Any] = {}
        distance = np.zeros((len(state.clients), len(layers)))
        for row, (partition_id, update) in enumerate(state.clients.items()):
            w = update.arrays
            distance[row] = [_norm(w[k] - g[k]) / (_norm(g[k]) or 1.0) for k in layers]
            entry = {
                "relative_distance": _norm(flat(w) - g_flat) / (_norm(g_flat) or 1.0),
                "update_norm": _norm(flat(w) - flat(p)),
                "update_cosine": _cosine(flat(w) - flat(p), step),
                "support_iou": float(np.mean([support_iou(w[k], g[k]) for k in layers])),
            }
            if self.params.per_layer:
                entry["layer_relative_distance"] = dict(zip(layers, distance[row].tolist()))
            clients[str(partition_id)] = entry
        summary = {
            key: float(np.mean([c[key] for c in clients.values() if c[key] is not None] or [np.nan]))
            for key in ("relative_distance", "update_cosine", "support_iou")
        }
        return DiagnosticResult(
            metrics={"mean": summary, "clients": clients, "layers": layers},
            arrays={"relative_distance": distance, "partition_ids": np.array(list(state.clients), dtype=np.int64)},
        )

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        from fedmech_flwr.api.diagnostic import line_plot

        series: dict[str, dict[str, list[tuple[int, float]]]] = {"relative_distance": {}, "update_cosine": {}, "support_iou": {}}
        for rec in records:
            for partition_id, entry in rec["clients"].items():
                for key, lines in series.items():
                    if entry[key] is not None:
                        lines.setdefault(f"client {partition_id}", []).append((rec["round"], entry[key]))
        titles = {
            "relative_distance": "Client drift ||w_i - g|| / ||g||",
            "update_cosine": "cos(client update, global update)",
            "support_iou": "Non-zero support IoU, client vs global",
        }
        return [
            line_plot(lines, titles[key], key.replace("_", " "), plots_dir / f"weight_divergence_{key}.png")
            for key, lines in series.items()
            if lines
        ]
