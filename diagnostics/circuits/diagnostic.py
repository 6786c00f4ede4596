"""The ``circuits`` diagnostic: class circuits of every client and of the global model,
how they survive aggregation, and whether they suffice (arXiv 2512.23043).

Where each part runs:

- in the ClientApp after local training (``client_side``): the client's *local*
  circuits, on its own data, for the classes it holds (at least ``min_class_samples``
  samples); the others are absent, never filled from data the client never had;
- in the ClientApp on the new aggregate (``client_side_global``, a ``query.diagnose``
  round trip): the *global model's* circuits in that client's context (its data);
- on the server (``server_side``): IoUs, prediction checks and sufficiency / necessity
  ablations on the server's test set (a balanced, seeded subset of ``ablation_samples``
  images); with ``audit: true``, also the global model's circuits on the server-held audit set
  (``data.audit_per_class``), compared per class with its circuits in client contexts
  (``audit_vs_client_context``) and ablated (variant ``audit``).

Masks travel as packed bytes (one bit per channel). Metrics per round, each per class and
as a mean over classes, each next to the number of pairs its mean covers (``pairs``), the
pairs left out as undefined (``undefined``) and the empty circuits it involved (``empty``):

- ``intra_client``: a client's class-c circuit vs its circuit at its previous participation;
- ``inter_client``: mean IoU over pairs of clients that both hold class c;
- ``local_to_global``: client i's local circuit vs the global model's circuit in client i's
  context;
- ``inter_class_local`` / ``inter_class_global``: mean IoU between different classes'
  circuits within one model (low = distinct circuits);
- ``sizes``: mean channels per layer of local and global circuits;
- ``circuit_counts``: per kind (local, global, audit) how many circuits, how many empty, and
  how many of those are *bias-only*: the model predicts the class for most of its test
  images with every gated channel closed, so the prediction needs no gated channel (its
  head's bias or ungated paths alone); per class, ``empty`` and ``bias_only`` list the
  clients;
- ``predictions``: each model's most predicted class and its share of the test images
  (above ``DEGENERATE_FRACTION`` a degenerate predictor, warned about);
- ``ablation``: for ``global`` (the global model with its own circuits), ``cross`` (client
  i's local circuit applied to the global model) and ``local`` (each client's model with
  its circuit): class-c recall, whole-test accuracy, the fraction predicted as c and the
  largest fraction predicted as any class, for sufficiency and necessity with zero / mean
  fill, next to a random circuit of the same size per layer and the unablated baseline;
  means over the clients holding the class, and how many of them have a degenerate
  sufficiency ablation (``degenerate_sufficiency``).

Each ablation score carries ``ci95``, the half-width of its 95% Wilson interval on the
``images`` (``class_images`` of the class) it was measured on; the record also holds the
seconds of each part (``client_seconds``, ``server_seconds``) and the gate steps each
client's discovery took (``client_steps``).

Cost (benchmarks/circuits_round.py, docs/explanation/benchmarks.md): discovery stops each class once
its mask is stable (``gates.patience``; null is the paper's fixed 300 steps); all
ablations of a model run as one batched pass; discovery, ablations and features run on a
channels-last copy of the model; on SimpleCNN discovery gates each channel at its block's
end (after ReLU and max-pool), with the same circuits at a quarter of the elements; on a
pruned SimpleCNN, STE discovery and the ablations run through its grouped forward, which
computes the channels that do not depend on the input once per class or ablation group.
Changed defaults and random streams: ``gates.patience`` 30 and ``gates.min_steps`` 100
(was: none), so a class stops after ~140-180 steps with masks of mean IoU >= 0.95 with
the full run's; a stopped class draws no more samples from its own generator (the others'
are untouched); random control circuits are drawn in the same order (variant, client,
class) from the same per-round generator as before. Warm starts (``learn_circuits``'s
``start``) are not used: the global model's circuit started from the client's local one
stayed at the local mask (mean IoU 0.79 with the cold-start mask, 0.96 with the local
one), which would make ``local_to_global`` measure the start, not the model.

IoU = mean over gated layers of |A n B| / |A u B|, layers empty in both circuits left out;
a pair of empty circuits has no IoU (null, excluded from means and counted) unless
``empty_iou`` gives one (1.0, the paper's convention, recorded as ``empty_iou``). Every round
logs one summary line and warns when most circuits of a kind are empty or a model is a
degenerate predictor.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, Metric, Outputs, torch_generator
from fedmech_flwr.api._builtin import (
    DEGENERATE_FRACTION,
    Clock,
    largest_predicted_class,
    lookup,
    pack_masks,
    to_bools,
    unpack_masks,
)
from fedmech_flwr.api.diagnostic import (
    DIAGNOSTICS,
    ClientContext,
    Diagnostic,
    DiagnosticResult,
    GlobalContext,
    RoundState,
)

from .ablation import (
    ablation_reports,
    channel_means,
    predict,
    random_like,
    without_channels,
)
from .discovery import discover_circuits, learn_circuits
from .gates import GateConfig
from .metrics import IOU_KEYS, circuit_iou, circuit_size, empty_iou_convention, is_empty
from .plots import draw

log = logging.getLogger(__name__)

Variant = Literal["global", "cross", "local"]
PAIR_KEYS = IOU_KEYS[:3]
"""The IoUs between circuits of one class (per class, then a mean over classes)."""


@dataclass
class CircuitsConfig:
    gates: GateConfig = field(default_factory=GateConfig)
    """How circuits are discovered (the paper's STE gates by default)."""
    min_class_samples: int = field(default=20, metadata={"ge": 1})
    """A client holds class c if it has at least this many samples of c."""
    empty_iou: float | None = field(default=None, metadata={"ge": 0.0, "le": 1.0})
    """IoU of a layer empty in both circuits. null (default): undefined, left out of every
    mean and counted (``undefined``); 1.0 is the paper's code's convention ("they agree"),
    used only when set here and named in the records (``empty_iou``) and plot titles."""
    ablations: list[Literal["global", "cross", "local"]] = field(default_factory=lambda: ["global", "cross"])
    """Which sufficiency / necessity ablations to run on the server (may be empty)."""
    fills: list[Literal["zero", "mean"]] = field(default_factory=lambda: ["zero", "mean"])
    """How removed channels are filled: 0, or their mean activation on the ablation set."""
    ablation_samples: int = field(default=500, metadata={"ge": 10})
    """Balanced, seeded subset of the test set used for ablations (was 1,000: the
    ablations cost as much as the rest of the diagnostic; each score now carries its
    sampling interval, ``ci95``, about +-0.14 on a class's 50 images at recall 0.5)."""
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


def _predictions(global_model, local_models, xs: torch.Tensor) -> dict[str, Any]:
    """Each model's most predicted class on ``xs`` and its share of them (above
    ``DEGENERATE_FRACTION`` the model is a degenerate predictor)."""

    def summary(model) -> dict[str, Any]:
        top, fraction = largest_predicted_class(predict(model, xs), model.num_classes)
        return {"max_predicted_class": top, "max_predicted_fraction": fraction}

    return {"images": len(xs), "global": summary(global_model),
            "clients": {str(partition_id): summary(m) for partition_id, m in local_models.items()}}


def _summary(key: str, scores: list[float | None], empty: int) -> dict[str, Any]:
    """``key``: mean of the defined IoUs (None if there are none); ``key_pairs``: how many
    pairs that mean covers; ``key_undefined``: pairs left out (every layer empty in both
    circuits and no ``empty_iou``); ``key_empty``: empty circuits among all the pairs."""
    defined = [v for v in scores if v is not None]
    return {key: _mean(defined), f"{key}_pairs": len(defined), f"{key}_undefined": len(scores) - len(defined),
            f"{key}_empty": empty}


def _balanced_subset(y: torch.Tensor, total: int, num_classes: int, generator: torch.Generator) -> torch.Tensor:
    per_class = max(1, total // num_classes)
    picks = [idx[torch.randperm(len(idx), generator=generator)[:per_class]]
             for c in range(num_classes) if len(idx := torch.nonzero(y.cpu() == c).flatten())]
    return torch.cat(picks)


def check_circuits(params: CircuitsConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """``audit: true`` needs an audit set to find the global model's circuits on."""
    if params.audit and data.audit_per_class == 0:
        raise ConfigError("circuits.audit is true but the run has no audit set (data.audit_per_class is 0); "
                          "set data.audit_per_class > 0", f"{where}.audit")


def mostly_empty(key: str) -> Callable[[dict[str, Any]], str | None]:
    """Flag an IoU of which at least half the circuits behind it are empty (an empty
    circuit's IoU with any other is 0 or undefined: it measures emptiness, not overlap)."""
    def rule(record: dict[str, Any]) -> str | None:
        pairs = sum(v for part in ("pairs", "undefined") if isinstance(v := lookup(record, (part, key)), float))
        empty = lookup(record, ("empty", key))
        return "mostly empty circuits" if pairs and isinstance(empty, float) and empty >= pairs else None
    return rule


OUTPUTS = Outputs("Circuit IoU (circuits diagnostic)", {
    key: Metric(label, ("mean", key), "IoU", 2, empty=("empty", key), flag=mostly_empty(key))
    for key, label in (("intra_client", "intra-client"), ("inter_client", "inter-client"),
                       ("local_to_global", "local-to-global"))
}, curves=PAIR_KEYS, headline=("local_to_global",))
"""The mean IoUs over classes, each flagged when mostly empty circuits are behind it."""


@DIAGNOSTICS.register("circuits", CircuitsConfig, check=check_circuits, outputs=OUTPUTS)
class Circuits(Diagnostic):
    """Class circuits per client and of the global model; IoU tracking; ablations."""

    def __init__(self, params: CircuitsConfig) -> None:
        super().__init__(params)
        self._previous: dict[int, dict[int, dict[str, np.ndarray]]] = {}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Each client's latest class circuits, as ``<partition id>/<class>/<layer>``: the
        ``intra_client`` IoU of a resumed run needs them (``fedmech_flwr.contracts.hooks.Resumable``)."""
        return {f"{partition_id}/{c}/{layer}": mask for partition_id, classes in self._previous.items()
                for c, masks in classes.items() for layer, mask in masks.items()}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self._previous = {}
        for key, mask in arrays.items():
            partition_id, c, layer = key.split("/", 2)
            self._previous.setdefault(int(partition_id), {}).setdefault(int(c), {})[layer] = mask

    def _discover(self, model, x, y, num_classes: int, generator: torch.Generator) -> dict[str, Any]:
        held = _held(y, num_classes, self.params.min_class_samples)
        start = time.perf_counter()
        found = learn_circuits(model, x, y, held, self.params.gates, generator) if held else None
        return {"held": held, "masks": pack_masks(found.masks if found else {}), "seconds": time.perf_counter() - start,
                "steps": found.steps if found else None}

    def client_side(self, ctx: ClientContext) -> dict[str, Any]:
        return self._discover(ctx.local_model, ctx.x, ctx.y, ctx.num_classes,
                              torch_generator(ctx.seed, "circuits-local", ctx.partition_id, ctx.server_round))

    def client_side_global(self, ctx: GlobalContext) -> dict[str, Any]:
        return self._discover(ctx.global_model, ctx.x, ctx.y, ctx.num_classes,
                              torch_generator(ctx.seed, "circuits-global", ctx.partition_id, ctx.server_round))

    def server_side(self, state: RoundState) -> DiagnosticResult:
        p = self.params
        clock = Clock()
        global_model = state.build_model(state.global_arrays)
        sizes = global_model.gated_layers()
        local = {partition_id: unpack_masks(u.diagnostics["circuits"]["masks"], sizes)
                 for partition_id, u in state.clients.items() if "circuits" in u.diagnostics}
        glob = {partition_id: unpack_masks(u.global_diagnostics["circuits"]["masks"], sizes)
                for partition_id, u in state.clients.items() if "circuits" in u.global_diagnostics}
        iou = lambda a, b: circuit_iou(a, b, p.empty_iou)  # noqa: E731

        per_class: dict[int, dict[str, Any]] = {}
        for c in range(state.num_classes):
            holders = sorted(partition_id for partition_id in local if c in local[partition_id])
            pairs = {
                "intra_client": [(local[i][c], self._previous[i][c]) for i in holders if c in self._previous.get(i, {})],
                "inter_client": [(local[i][c], local[j][c]) for i, j in itertools.combinations(holders, 2)],
                "local_to_global": [(local[i][c], glob[i][c]) for i in holders if c in glob.get(i, {})],
            }
            per_class[c] = {"clients": holders}
            for key, items in pairs.items():
                per_class[c].update(_summary(key, [iou(a, b) for a, b in items],
                                             sum(is_empty(m) for pair in items for m in pair)))

        mean = {key: _mean([v[key] for v in per_class.values() if v[key] is not None]) for key in PAIR_KEYS}
        counts = {part: {key: sum(v[f"{key}_{part}"] for v in per_class.values()) for key in PAIR_KEYS}
                  for part in ("pairs", "undefined", "empty")}
        for key, models in (("inter_class_local", local), ("inter_class_global", glob)):
            scores = [iou(m[a], m[b]) for m in models.values() for a, b in itertools.combinations(sorted(m), 2)]
            empty = sum(is_empty(mask) for m in models.values() for mask in m.values())
            summary = _summary(key, scores, empty)
            mean[key] = summary[key]
            for part in counts:
                counts[part][key] = summary[f"{key}_{part}"]

        clock.lap("iou")
        audit = self._audit_circuits(state, global_model) if p.audit else {}
        clock.lap("audit_discovery")
        for c in audit:
            with_circuit = [partition_id for partition_id in sorted(glob) if c in glob[partition_id]]
            scores = [iou(glob[partition_id][c], audit[c]) for partition_id in with_circuit]
            empty = sum(is_empty(glob[partition_id][c]) for partition_id in with_circuit) + is_empty(audit[c])
            per_class[c].update(_summary("audit_vs_client_context", scores, empty))
        if audit:
            key = "audit_vs_client_context"
            mean[key] = _mean([v[key] for v in per_class.values() if v.get(key) is not None])
            for part in counts:
                counts[part][key] = sum(v.get(f"{key}_{part}", 0) for v in per_class.values())

        xs, ys = self._ablation_set(state)
        local_models = {partition_id: state.build_model(state.clients[partition_id].arrays)
                        for partition_id in sorted(local)}
        predictions = _predictions(global_model, local_models, xs)
        circuit_counts = self._empty_circuits(global_model, local_models, local, glob, audit, per_class, xs, ys)
        clock.lap("checks")

        result_sizes = {
            kind: {layer: _mean([circuit_size(mask)[layer] for m in models.values() for mask in m.values()])
                   for layer in sizes}
            for kind, models in (("local", local), ("global", glob))
        }
        generator = torch_generator(state.seed, "circuits-ablation", None, state.server_round)
        ablation = (self._ablations(global_model, local_models, local, glob, audit, xs, ys, generator)
                    if p.ablations or audit else {})
        clock.lap("ablations")
        self._previous.update(local)

        arrays = {
            f"{kind}/{partition_id}/{c}/{layer}": mask.astype(np.uint8)
            for kind, models in (("local", local), ("global", glob))
            for partition_id, m in models.items() for c, layers in m.items() for layer, mask in layers.items()
        }
        arrays.update({f"audit/{c}/{layer}": to_bools(mask).astype(np.uint8)
                       for c, layers in audit.items() for layer, mask in layers.items()})
        client_seconds = {str(partition_id): {"local": u.diagnostics.get("circuits", {}).get("seconds"),
                                              "global": u.global_diagnostics.get("circuits", {}).get("seconds")}
                          for partition_id, u in state.clients.items()}
        client_steps = {str(partition_id): {"local": u.diagnostics.get("circuits", {}).get("steps"),
                                            "global": u.global_diagnostics.get("circuits", {}).get("steps")}
                        for partition_id, u in state.clients.items()}
        metrics = {"empty_iou": p.empty_iou, "mean": mean, **counts, "per_class": {str(c): v for c, v in per_class.items()},
                   "circuit_counts": circuit_counts, "predictions": predictions, "sizes": result_sizes,
                   "ablation": ablation, "client_seconds": client_seconds, "client_steps": client_steps, "server_seconds": clock.laps,
                   "moving_average": p.moving_average}
        _log_round(state.server_round, metrics)
        return DiagnosticResult(metrics=metrics, arrays=arrays)

    def _ablation_set(self, state: RoundState) -> tuple[torch.Tensor, torch.Tensor]:
        """The balanced, seeded test subset that ablations and prediction checks run on."""
        x_test, y_test = state.datasets["test"]
        subset = _balanced_subset(y_test, self.params.ablation_samples, state.num_classes,
                                  torch_generator(state.seed, "circuits-ablation-set", None, state.server_round))
        return x_test[subset.to(x_test.device)], y_test[subset.to(y_test.device)].cpu()

    def _empty_circuits(self, global_model, local_models, local, glob, audit, per_class, xs, ys) -> dict[str, Any]:
        """Per kind of circuit how many there are, how many are empty and how many of those
        are bias-only: the model predicts the class for most of its images in ``xs`` with
        every gated channel closed. Adds ``empty`` and ``bias_only`` (the clients) to each
        class of ``per_class``."""
        position = self.params.gates.position
        closed_global = without_channels(global_model, xs, position)
        closed = {partition_id: without_channels(m, xs, position) for partition_id, m in local_models.items()
                  if any(is_empty(mask) for mask in local[partition_id].values())}

        def bias_only(pred: torch.Tensor, c: int) -> bool:
            in_class = ys == c
            return bool(in_class.any()) and float((pred[in_class] == c).float().mean()) > 0.5

        counts = {}
        for kind, models, preds in (("local", local, closed), ("global", glob, None)):
            empty = {c: [partition_id for partition_id in sorted(models)
                         if c in models[partition_id] and is_empty(models[partition_id][c])]
                     for c in per_class}
            biased = {c: [partition_id for partition_id in partition_ids
                          if bias_only(closed_global if preds is None else preds[partition_id], c)]
                      for c, partition_ids in empty.items()}
            for c in per_class:
                per_class[c].setdefault("empty", {})[kind] = empty[c]
                per_class[c].setdefault("bias_only", {})[kind] = biased[c]
            counts[kind] = {"circuits": sum(len(m) for m in models.values()),
                            "empty": sum(map(len, empty.values())), "bias_only": sum(map(len, biased.values()))}
        if audit:
            empty_audit = [c for c, mask in audit.items() if is_empty(mask)]
            counts["audit"] = {"circuits": len(audit), "empty": len(empty_audit),
                               "bias_only": sum(bias_only(closed_global, c) for c in empty_audit)}
        return counts

    def _audit_circuits(self, state: RoundState, global_model) -> dict[int, dict[str, Any]]:
        x, y = state.datasets["audit"]
        generator = torch_generator(state.seed, "circuits-audit", None, state.server_round)
        return discover_circuits(global_model, x, y, _held(y, state.num_classes, 1), self.params.gates, generator)

    def _ablations(self, global_model, local_models, local, glob, audit, xs, ys, generator: torch.Generator) -> dict[str, Any]:
        """Every variant's ablation reports, one batched pass per model (the global model's
        variants share one). Random circuits are drawn in the order variant, client, class."""
        p = self.params
        position = p.gates.position

        def means_of(model):
            return channel_means(model, xs, position=position) if "mean" in p.fills else None

        jobs: dict[str, list[tuple[Any, int, Any]]] = defaultdict(list)
        for partition_id in sorted(local):
            for c, mask in local[partition_id].items():
                if "cross" in p.ablations:
                    jobs["cross"].append((global_model, c, mask))
                if "global" in p.ablations and c in glob.get(partition_id, {}):
                    jobs["global"].append((global_model, c, glob[partition_id][c]))
            if "local" in p.ablations and local[partition_id]:
                jobs["local"].extend((local_models[partition_id], c, mask) for c, mask in local[partition_id].items())
        if audit:
            jobs["audit"] = [(global_model, c, mask) for c, mask in audit.items()]
        sizes = global_model.gated_layers()
        flat = [(variant, model, (c, mask, random_like(mask, sizes, generator)))
                for variant, items in jobs.items() for model, c, mask in items]
        reports: dict[str, dict[int, list]] = {variant: defaultdict(list) for variant in jobs}
        for model in {id(m): m for _, m, _ in flat}.values():
            mine = [(variant, job) for variant, m, job in flat if m is model]
            done = ablation_reports(model, xs, ys, [job for _, job in mine], means_of(model), position)
            for (variant, (c, _, _)), report in zip(mine, done):
                reports[variant][c].append(_drop_unused_fills(report, p.fills))
        return {variant: {str(c): _average_reports(rs) for c, rs in by_class.items()}
                for variant, by_class in reports.items()}

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        return draw(records, plots_dir, class_names)


def _log_round(server_round: int, m: dict[str, Any]) -> None:
    """One console line per round, as the misalignment diagnostic has, and warnings when
    most circuits of a kind are empty or a model or sufficiency ablation is degenerate."""

    def iou(key: str) -> str:
        value = "n/a" if m["mean"][key] is None else f"{m['mean'][key]:.2f}"
        undefined = f", {m['undefined'][key]} undefined" if m["undefined"][key] else ""
        return f"{key} {value} ({m['pairs'][key]} pairs{undefined})"

    counts = m["circuit_counts"]
    empty = ", ".join(f"{kind} {c['empty']}/{c['circuits']}" + (f" ({c['bias_only']} bias-only)" if c["empty"] else "")
                      for kind, c in counts.items())
    log.info("round %d | circuit IoU %s | empty circuits: %s", server_round, ", ".join(iou(k) for k in PAIR_KEYS), empty)
    for kind, c in counts.items():
        if c["circuits"] and c["empty"] > c["circuits"] / 2:
            log.warning("round %d: %d of %d %s circuits are empty (%d bias-only: the model predicts the class with "
                        "every gated channel closed); %s", server_round, c["empty"], c["circuits"], kind, c["bias_only"],
                        empty_iou_convention(m["empty_iou"]))
    models = {"global model": m["predictions"]["global"],
              **{f"client {partition_id}": v for partition_id, v in m["predictions"]["clients"].items()}}
    degenerate = [f"{name} (class {v['max_predicted_class']}: {100 * v['max_predicted_fraction']:.0f}%)"
                  for name, v in models.items() if v["max_predicted_fraction"] > DEGENERATE_FRACTION]
    if degenerate:
        log.warning("round %d: degenerate predictor(s), one class for > %.0f%% of %d test images: %s", server_round,
                    100 * DEGENERATE_FRACTION, m["predictions"]["images"], ", ".join(degenerate))
    sufficiency = {variant: (sum(r["degenerate_sufficiency"] for r in by_class.values()),
                             sum(r["clients"] for r in by_class.values()))
                   for variant, by_class in m["ablation"].items()}
    flagged = [f"{variant} {bad} of {total}" for variant, (bad, total) in sufficiency.items() if bad]
    if flagged:
        log.warning("round %d: sufficiency ablations that predict one class for > %.0f%% of the test images: %s",
                    server_round, 100 * DEGENERATE_FRACTION, ", ".join(flagged))


def _drop_unused_fills(report: dict[str, Any], fills: list[str]) -> dict[str, Any]:
    for label in ("circuit", "random"):
        report[label] = {mode: {f: s for f, s in by_fill.items() if f in fills} for mode, by_fill in report[label].items()}
    return report


def _average_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of the numeric leaves of several ablation reports (None-aware), their count
    (``clients``), and how many of them have a degenerate sufficiency ablation: with only
    the circuit kept, one class for more than ``DEGENERATE_FRACTION`` of the images in
    some fill (``degenerate_sufficiency``)."""

    def merge(items: list[Any]) -> Any:
        if isinstance(items[0], dict):
            return {k: merge([it[k] for it in items]) for k in items[0]}
        values = [v for v in items if isinstance(v, (int, float))]
        return float(np.mean(values)) if values else None

    merged = merge([{k: r[k] for k in ("images", "class_images", "baseline", "circuit", "random")} for r in reports])
    merged["clients"] = len(reports)
    merged["degenerate_sufficiency"] = sum(
        any(s["max_predicted_fraction"] > DEGENERATE_FRACTION for s in r["circuit"]["sufficiency"].values())
        for r in reports
    )
    return merged
