"""The ``circuits`` diagnostic: class circuits of every client and of the global model,
how they survive aggregation, and whether they suffice (arXiv 2512.23043).

Where each part runs:

- in the ClientApp after local training (``client_side``): the client's *local*
  circuits, on its own data, for the classes it holds (at least ``min_class_samples``
  samples); the others are absent, never filled from data the client never had;
- in the ClientApp on the new aggregate (``client_side_global``, a ``query.diagnose``
  round trip): the *global model's* circuits in that client's context (its data);
- on the server (``server_side``): IoUs and sufficiency / necessity ablations on the
  server's test set (a balanced, seeded subset of ``ablation_samples`` images); with
  ``audit: true``, also the global model's circuits on the server-held audit set
  (``data.audit_per_class``), compared per class with its circuits in client contexts
  (``audit_vs_client_context``) and ablated (variant ``audit``).

Masks travel as packed bytes (one bit per channel). Metrics per round, each per class and
as a mean over classes, each next to the number of empty circuits it involved:

- ``intra_client``: a client's class-c circuit vs its circuit at its previous participation;
- ``inter_client``: mean IoU over pairs of clients that both hold class c;
- ``local_to_global``: client i's local circuit vs the global model's circuit in client i's
  context;
- ``inter_class_local`` / ``inter_class_global``: mean IoU between different classes'
  circuits within one model (low = distinct circuits);
- ``sizes``: mean channels per layer of local and global circuits;
- ``ablation``: for ``global`` (the global model with its own circuits), ``cross`` (client
  i's local circuit applied to the global model) and ``local`` (each client's model with
  its circuit): class-c recall, whole-test accuracy and the fraction predicted as c, for
  sufficiency and necessity with zero / mean fill, next to a random circuit of the same
  size per layer and the unablated baseline; means over the clients holding the class.

IoU = mean over gated layers of |A n B| / |A u B|; two empty layers score ``empty_iou``.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from diagnostics.circuits.ablation import ablation_report, channel_means
from diagnostics.circuits.discovery import discover_circuits
from diagnostics.circuits.gates import GateConfig
from diagnostics.circuits.metrics import circuit_iou, circuit_size, is_empty, pack_masks, to_bools, unpack_masks
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.hooks import (
    DIAGNOSTICS,
    ClientContext,
    Diagnostic,
    DiagnosticResult,
    GlobalContext,
    RoundState,
)
from fedmech_flwr.plotting import heatmap, line_plot

Variant = Literal["global", "cross", "local"]
IOU_KEYS = ("intra_client", "inter_client", "local_to_global", "inter_class_local", "inter_class_global")


@dataclass
class CircuitsConfig:
    gates: GateConfig = field(default_factory=GateConfig)
    """How circuits are discovered (the paper's STE gates by default)."""
    min_class_samples: int = field(default=20, metadata={"ge": 1})
    """A client holds class c if it has at least this many samples of c."""
    empty_iou: float = field(default=1.0, metadata={"ge": 0.0, "le": 1.0})
    """IoU of two empty layers (the paper's code uses 1.0); empty counts are reported."""
    ablations: list[Literal["global", "cross", "local"]] = field(default_factory=lambda: ["global", "cross"])
    """Which sufficiency / necessity ablations to run on the server (may be empty)."""
    fills: list[Literal["zero", "mean"]] = field(default_factory=lambda: ["zero", "mean"])
    """How removed channels are filled: 0, or their mean activation on the ablation set."""
    ablation_samples: int = field(default=1000, metadata={"ge": 10})
    """Balanced, seeded subset of the test set used for ablations."""
    audit: bool = False
    """Also find the global model's circuits on the server's audit set (needs
    ``data.audit_per_class`` > 0) and compare them with its circuits in client contexts."""
    moving_average: int = field(default=1, metadata={"ge": 1})
    """Window of the moving average drawn over the IoU curves (1: none)."""


def _held(y: torch.Tensor, num_classes: int, minimum: int) -> list[int]:
    counts = torch.bincount(y.cpu(), minlength=num_classes)
    return [c for c in range(num_classes) if counts[c] >= minimum]


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _balanced_subset(y: torch.Tensor, total: int, num_classes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    per_class = max(1, total // num_classes)
    picks = [idx[torch.randperm(len(idx), generator=g)[:per_class]]
             for c in range(num_classes) if len(idx := torch.nonzero(y.cpu() == c).flatten())]
    return torch.cat(picks)


@DIAGNOSTICS.register("circuits", CircuitsConfig)
class Circuits(Diagnostic):
    """Class circuits per client and of the global model; IoU tracking; ablations."""

    def __init__(self, params: CircuitsConfig) -> None:
        super().__init__(params)
        self._previous: dict[int, dict[int, dict[str, np.ndarray]]] = {}

    def check(self, num_classes: int, audit_per_class: int, where: str) -> None:
        if self.params.audit and audit_per_class == 0:
            raise ConfigError("circuits.audit is true but the run has no audit set; set data.audit_per_class > 0",
                              f"{where}.audit")

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Each client's latest class circuits, as ``<partition>/<class>/<layer>``: the
        ``intra_client`` IoU of a resumed run needs them (``fedmech_flwr.protocol.Resumable``)."""
        return {f"{pid}/{c}/{layer}": mask for pid, classes in self._previous.items()
                for c, masks in classes.items() for layer, mask in masks.items()}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self._previous = {}
        for key, mask in arrays.items():
            pid, c, layer = key.split("/", 2)
            self._previous.setdefault(int(pid), {}).setdefault(int(c), {})[layer] = mask

    def _discover(self, model, x, y, num_classes: int, seed: tuple[int, ...]) -> dict[str, Any]:
        held = _held(y, num_classes, self.params.min_class_samples)
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1)[0]))
        masks = discover_circuits(model, x, y, held, self.params.gates, generator) if held else {}
        return {"held": held, "masks": pack_masks(masks), "seconds": time.perf_counter() - start}

    def client_side(self, ctx: ClientContext) -> dict[str, Any]:
        return self._discover(ctx.local_model, ctx.x, ctx.y, ctx.num_classes, (ctx.server_round, ctx.partition_id, 1))

    def client_side_global(self, ctx: GlobalContext) -> dict[str, Any]:
        return self._discover(ctx.global_model, ctx.x, ctx.y, ctx.num_classes, (ctx.server_round, ctx.partition_id, 2))

    def server_side(self, state: RoundState) -> DiagnosticResult:
        p = self.params
        global_model = state.build_model(state.global_arrays)
        sizes = global_model.gated_layers()
        local = {pid: unpack_masks(u.diagnostics["circuits"]["masks"], sizes)
                 for pid, u in state.clients.items() if "circuits" in u.diagnostics}
        glob = {pid: unpack_masks(u.global_diagnostics["circuits"]["masks"], sizes)
                for pid, u in state.clients.items() if "circuits" in u.global_diagnostics}
        iou = lambda a, b: circuit_iou(a, b, p.empty_iou)  # noqa: E731

        per_class: dict[int, dict[str, Any]] = {}
        for c in range(state.num_classes):
            holders = sorted(pid for pid in local if c in local[pid])
            pairs = {
                "intra_client": [(local[i][c], self._previous[i][c]) for i in holders if c in self._previous.get(i, {})],
                "inter_client": [(local[i][c], local[j][c]) for i, j in itertools.combinations(holders, 2)],
                "local_to_global": [(local[i][c], glob[i][c]) for i in holders if c in glob.get(i, {})],
            }
            per_class[c] = {"clients": holders}
            for key, items in pairs.items():
                per_class[c][key] = _mean([iou(a, b) for a, b in items])
                per_class[c][f"{key}_empty"] = sum(is_empty(m) for pair in items for m in pair)

        distinct = {"inter_class_local": local, "inter_class_global": glob}
        mean = {key: _mean([v[key] for v in per_class.values() if v[key] is not None]) for key in IOU_KEYS[:3]}
        empty = {key: sum(v[f"{key}_empty"] for v in per_class.values()) for key in IOU_KEYS[:3]}
        for key, models in distinct.items():
            scores = [iou(m[a], m[b]) for m in models.values() for a, b in itertools.combinations(sorted(m), 2)]
            mean[key] = _mean(scores)
            empty[key] = sum(is_empty(mask) for m in models.values() for mask in m.values())

        audit = self._audit_circuits(state, global_model) if p.audit else {}
        for c in audit:
            scores = [iou(glob[pid][c], audit[c]) for pid in sorted(glob) if c in glob[pid]]
            per_class[c]["audit_vs_client_context"] = _mean(scores)
        if audit:
            mean["audit_vs_client_context"] = _mean(
                [v["audit_vs_client_context"] for v in per_class.values() if v.get("audit_vs_client_context") is not None]
            )

        result_sizes = {
            kind: {layer: _mean([circuit_size(mask)[layer] for m in models.values() for mask in m.values()])
                   for layer in sizes}
            for kind, models in (("local", local), ("global", glob))
        }
        ablation = self._ablations(state, global_model, local, glob, audit) if p.ablations or audit else {}
        self._previous.update(local)

        arrays = {
            f"{kind}/{pid}/{c}/{layer}": mask.astype(np.uint8)
            for kind, models in (("local", local), ("global", glob))
            for pid, m in models.items() for c, layers in m.items() for layer, mask in layers.items()
        }
        arrays.update({f"audit/{c}/{layer}": to_bools(mask).astype(np.uint8)
                       for c, layers in audit.items() for layer, mask in layers.items()})
        client_seconds = {str(pid): {"local": u.diagnostics.get("circuits", {}).get("seconds"),
                                     "global": u.global_diagnostics.get("circuits", {}).get("seconds")}
                          for pid, u in state.clients.items()}
        return DiagnosticResult(
            metrics={"mean": mean, "empty": empty, "per_class": {str(c): v for c, v in per_class.items()},
                     "sizes": result_sizes, "ablation": ablation, "client_seconds": client_seconds,
                     "moving_average": p.moving_average},
            arrays=arrays,
        )

    def _audit_circuits(self, state: RoundState, global_model) -> dict[int, dict[str, Any]]:
        x, y = state.datasets["audit"]
        generator = torch.Generator().manual_seed(state.server_round)
        return discover_circuits(global_model, x, y, _held(y, state.num_classes, 1), self.params.gates, generator)

    def _ablations(self, state: RoundState, global_model, local, glob, audit) -> dict[str, Any]:
        p = self.params
        x_test, y_test = state.datasets["test"]
        subset = _balanced_subset(y_test, p.ablation_samples, state.num_classes, seed=state.server_round)
        xs, ys = x_test[subset.to(x_test.device)], y_test[subset.to(y_test.device)]
        position = p.gates.position
        generator = torch.Generator().manual_seed(state.server_round)

        def means_of(model):
            return channel_means(model, xs, position=position) if "mean" in p.fills else None

        jobs: dict[str, list[tuple[Any, Any, int, Any]]] = defaultdict(list)
        g_means = means_of(global_model)
        for pid in sorted(local):
            for c, mask in local[pid].items():
                if "cross" in p.ablations:
                    jobs["cross"].append((global_model, g_means, c, mask))
                if "global" in p.ablations and c in glob.get(pid, {}):
                    jobs["global"].append((global_model, g_means, c, glob[pid][c]))
            if "local" in p.ablations and local[pid]:
                model = state.build_model(state.clients[pid].arrays)
                l_means = means_of(model)
                jobs["local"].extend((model, l_means, c, mask) for c, mask in local[pid].items())
        if audit:
            jobs["audit"] = [(global_model, g_means, c, mask) for c, mask in audit.items()]
        out: dict[str, Any] = {}
        for variant, items in jobs.items():
            reports = defaultdict(list)
            for model, means, c, mask in items:
                report = ablation_report(model, xs, ys, c, mask, means, generator, position)
                reports[c].append(_drop_unused_fills(report, p.fills))
            out[variant] = {str(c): _average_reports(rs) for c, rs in reports.items()}
        return out

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path) -> list[Path]:
        if not records:
            return []
        window = records[-1].get("moving_average", 1)
        lines = {}
        for key in IOU_KEYS:
            points = [(r["round"], r["mean"][key]) for r in records if r["mean"].get(key) is not None]
            if points:
                lines[key.replace("_", " ")] = _moving_average(points, window)
        out = []
        if lines:
            title = "Circuit IoU over rounds" + (f" (moving average of {window})" if window > 1 else "")
            out.append(line_plot(lines, title, "IoU", plots_dir / "circuits_iou.png", (0.0, 1.05)))
        classes = sorted({int(c) for r in records for c in r["per_class"]})
        rounds = [r["round"] for r in records]
        matrix = np.array([[np.nan if (v := r["per_class"].get(str(c), {}).get("local_to_global")) is None else v
                            for r in records] for c in classes])
        if np.isfinite(matrix).any():
            out.append(heatmap(matrix, rounds, [str(c) for c in classes],
                               "Local-to-global circuit IoU per class", plots_dir / "circuits_local_to_global.png"))
        size_lines = {
            f"{kind} circuits": [(r["round"], sum(v for v in r["sizes"][kind].values() if v is not None))
                                 for r in records if any(v is not None for v in r["sizes"][kind].values())]
            for kind in ("local", "global")
        }
        size_lines = {k: v for k, v in size_lines.items() if v}
        if size_lines:
            out.append(line_plot(size_lines, "Mean circuit size (channels over all gated layers)", "channels",
                                 plots_dir / "circuits_size.png"))
        return out


def _drop_unused_fills(report: dict[str, Any], fills: list[str]) -> dict[str, Any]:
    for label in ("circuit", "random"):
        report[label] = {mode: {f: s for f, s in by_fill.items() if f in fills} for mode, by_fill in report[label].items()}
    return report


def _average_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of the numeric leaves of several ablation reports (None-aware), plus their count."""

    def merge(items: list[Any]) -> Any:
        if isinstance(items[0], dict):
            return {k: merge([it[k] for it in items]) for k in items[0]}
        values = [v for v in items if isinstance(v, (int, float))]
        return float(np.mean(values)) if values else None

    merged = merge([{k: r[k] for k in ("baseline", "circuit", "random")} for r in reports])
    merged["clients"] = len(reports)
    return merged


def _moving_average(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    if window <= 1:
        return points
    values = [v for _, v in points]
    return [(r, float(np.mean(values[max(0, i - window + 1) : i + 1]))) for i, (r, _) in enumerate(points)]
