"""The ``misalignment`` diagnostic: are the global model's features preserved while its head
stops reading them? (arXiv 2512.23043, later version)

Every due round it puts side by side, on the test set, overall and per class:

- ``global``: the global model as it is (its own head);
- ``probe``: a fresh linear classifier on the global model's frozen penultimate features
  (standardised), trained on the audit set's training split, epoch selected on its
  validation split: how much class information the features still carry;
- ``realigned``: the global head finetuned alone on ``head_samples`` balanced samples of
  the training split, epoch selected on the validation split;
- ``realigned_test_selected``: the same finetuning with the epoch picked by test accuracy
  (the paper's public texts state no selection rule), reported under this name so it is
  never mistaken for a held-out number;
- ``tau_norm``: the head with tau-normalised class weights (no data at all);
- ``ncm`` / ``ccvr``: heads rebuilt from per-class statistics of the global model's
  features that the clients compute on their own data (no server data; one
  ``query.diagnose`` round trip);
- gaps ``probe - global`` and ``realigned - global``, overall and per class, as fractions of
  the test set (0.136 is 13.6 percentage points; the console and the table show pp).

Every head's record carries its most predicted class and that class's share of the test
images (``max_predicted_class``, ``max_predicted_fraction``): above ``DEGENERATE_FRACTION``
the head is a degenerate predictor, which its accuracy hides; the round's log line warns.

Optionally it also probes named gated layers (average-pooled) and every client's model.
The server's labelled data is the audit set (``data.audit_per_class``, held out from every
client), split per class into training and validation parts; never the test set. Features
are computed once per round and shared by every head. Only copies are changed: the global
weights are never touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.numpy import load as load_bytes
from safetensors.numpy import save as save_bytes

from fedmech_flwr.api import (
    DEGENERATE_FRACTION,
    DIAGNOSTICS,
    ClassStats,
    Clock,
    ConfigError,
    Covariance,
    DataInfo,
    Diagnostic,
    DiagnosticResult,
    ExperimentConfig,
    FedMechModel,
    GlobalContext,
    LinearHead,
    LinearTrainConfig,
    Metric,
    Outputs,
    RoundState,
    Scores,
    balanced_split,
    best_epoch,
    ccvr_head,
    ccvr_train_config,
    class_stats,
    features,
    features_at,
    head_set_per_class,
    ncm_head,
    one_class,
    score,
    seed_for,
    tau_normalize,
    torch_generator,
    train_linear,
)

log = logging.getLogger(__name__)

CURVES = ("global", "probe", "realigned", "realigned_test_selected", "tau_norm", "ncm", "ccvr")


@dataclass
class MisalignmentConfig:
    validation_fraction: float = field(default=0.2, metadata={"gt": 0.0, "lt": 1.0})
    """Share of each audit class that selects epochs; the rest is the training split."""
    probe: LinearTrainConfig = field(
        default_factory=lambda: LinearTrainConfig(epochs=50, batch_size=64, lr=1e-2, weight_decay=1e-3)
    )
    """How the linear probe is trained (from zero weights, on standardised features)."""
    probe_layers: list[str] = field(default_factory=list)
    """Gated layers to probe as well (average-pooled), e.g. [conv2]."""
    probe_clients: bool = False
    """Also probe every client's trained model (and score its own head)."""
    head_samples: int = field(default=200, metadata={"ge": 1})
    """Balanced samples the head is finetuned on (head_samples / classes per class)."""
    head: LinearTrainConfig = field(default_factory=LinearTrainConfig)
    """Head finetuning; the paper's recipe by default (AdamW 1e-3, wd 5e-4, cosine, 5
    epochs, batch 16)."""
    tau: float | None = field(default=1.0, metadata={"ge": 0.0})
    """tau of the tau-normalised head; null skips it."""
    client_stats: list[Literal["ncm", "ccvr"]] = field(default_factory=list)
    """Data-free heads from the clients' feature statistics of the global model."""
    ccvr_covariance: Covariance = "diagonal"
    ccvr_virtual_per_class: int = field(default=1000, metadata={"ge": 1})
    ccvr_train: LinearTrainConfig = field(default_factory=ccvr_train_config)


@dataclass
class _Splits:
    """Audit training/validation splits and the balanced head set, as indices."""

    train: torch.Tensor
    validation: torch.Tensor
    head: torch.Tensor


def _val_per_class(params: MisalignmentConfig, audit_per_class: int) -> int:
    return int(round(params.validation_fraction * audit_per_class))


def check_misalignment(params: MisalignmentConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """Probes and heads train on the audit set, and part of it selects their epochs."""
    data.require_audit("misalignment trains probes and heads on", where, suggested=100)
    val = _val_per_class(params, data.audit_per_class)
    if val < 1:
        raise ConfigError(
            f"validation_fraction {params.validation_fraction} of {data.audit_per_class} audit images per class "
            "leaves none to select epochs on; raise it or data.audit_per_class",
            f"{where}.validation_fraction",
        )
    head_set_per_class(params.head_samples, data.audit_per_class - val, data.num_classes, f"{where}.head_samples")


def _head(label: str, key: str, doc: str = "") -> Metric:
    return Metric(label, (key, "accuracy"), "%", better="higher", per_class=(key, "per_class"), flag=one_class((key,)),
                  doc=doc)


OUTPUTS = Outputs(
    "Preserved or misaligned (misalignment diagnostic)",
    {"global": _head("global", "global", "global model"),
     "probe": _head("probe", "probe", "linear probe on its frozen features"),
     "realigned": _head("realigned (val-selected)", "realigned", "its head retrained alone"),
     "realigned_test_selected": _head("realigned (test-selected)", "realigned_test_selected"),
     "ncm": _head("NCM", "ncm"), "ccvr": _head("CCVR", "ccvr"), "tau_norm": _head("tau-norm", "tau_norm"),
     "gaps.probe": Metric("probe − global", ("gaps", "probe"), "pp", per_class=("per_class_gaps", "probe"),
                          flag=one_class(("global",), ("probe",))),
     "gaps.realigned": Metric("realigned − global", ("gaps", "realigned"), "pp",
                              per_class=("per_class_gaps", "realigned"), flag=one_class(("global",), ("realigned",)))},
    curves=("gaps.probe",), headline=("probe", "gaps.probe"), by_skew=("global", "probe", "realigned"))
"""Every head's accuracy (one-class heads flagged) and the gaps the paper's claim is about."""


@DIAGNOSTICS.register("misalignment", MisalignmentConfig, check=check_misalignment, outputs=OUTPUTS)
class Misalignment(Diagnostic):
    """Global head vs linear probe vs realigned head, every due round."""

    def _splits(self, y: torch.Tensor, num_classes: int, seed: int) -> _Splits:
        generator = torch_generator(seed, "misalignment-split")
        val, train = balanced_split(y, _val_per_class(self.params, len(y) // num_classes), num_classes, generator)
        head, _ = balanced_split(y[train], self.params.head_samples // num_classes, num_classes, generator)
        return _Splits(train, val, train[head])

    def needs_global_pass(self) -> bool:
        return bool(self.params.client_stats)

    def client_side_global(self, ctx: GlobalContext) -> dict[str, Any]:
        start = time.perf_counter()
        covariance = self.params.ccvr_covariance if "ccvr" in self.params.client_stats else "diagonal"
        stats = class_stats(features(ctx.global_model, ctx.x), ctx.y, ctx.num_classes, covariance)
        return {"class_stats": save_bytes(stats.to_arrays()), "seconds": time.perf_counter() - start}

    def server_side(self, state: RoundState) -> DiagnosticResult:
        p, n = self.params, state.num_classes
        clock = Clock()
        x_audit, y_audit = state.datasets["audit"]
        x_test, y_test = state.datasets["test"]
        splits = self._splits(y_audit, n, state.seed)
        probe_seed = seed_for(state.seed, "misalignment-probe", None, state.server_round)
        model = state.build_model(state.global_arrays)
        f_audit, layers_audit = features_at(model, x_audit, p.probe_layers)
        f_test, layers_test = features_at(model, x_test, p.probe_layers)
        own = LinearHead.of(model)
        results: dict[str, Any] = {"global": _scores(score(own, f_test, y_test, n))}
        clock.lap("features")
        results["probe"] = self._probe(f_audit, y_audit, f_test, y_test, splits, n, probe_seed)
        clock.lap("probe")

        def head_data(idx):
            return f_audit[idx], y_audit[idx]

        generator = torch_generator(state.seed, "misalignment-head", None, state.server_round)
        snapshots = train_linear(*head_data(splits.head), own, p.head, generator)[1:]
        chosen = best_epoch(snapshots, *head_data(splits.validation), n)
        results["realigned"] = {**_scores(score(snapshots[chosen], f_test, y_test, n)), "epoch": chosen + 1}
        by_test = best_epoch(snapshots, f_test, y_test, n)
        results["realigned_test_selected"] = {
            **_scores(score(snapshots[by_test], f_test, y_test, n)),
            "epoch": by_test + 1,
            "note": "epoch selected on the test set (the paper's protocol); not a held-out number",
        }
        if p.tau is not None:
            results["tau_norm"] = _scores(score(tau_normalize(own, p.tau), f_test, y_test, n))
        clock.lap("realigned")
        if p.client_stats:
            results.update(self._from_client_stats(state, own, f_test, y_test))
        clock.lap("client_stats")
        results["gaps"] = {k: results[k]["accuracy"] - results["global"]["accuracy"] for k in ("probe", "realigned")}
        results["per_class_gaps"] = {
            k: _class_gap(results[k]["per_class"], results["global"]["per_class"]) for k in ("probe", "realigned")
        }
        for layer in p.probe_layers:
            results.setdefault("layers", {})[layer] = self._probe(layers_audit[layer], y_audit, layers_test[layer], y_test,
                                                                  splits, n, probe_seed)
        clock.lap("layers")
        if p.probe_clients:
            results["clients"] = {
                str(partition_id): self._client(state.build_model(update.arrays), x_audit, y_audit, x_test, y_test,
                                                splits, n, probe_seed)
                for partition_id, update in state.clients.items()
            }
        clock.lap("clients")
        results["server_seconds"] = clock.laps
        results["client_seconds"] = {str(partition_id): u.global_diagnostics.get("misalignment", {}).get("seconds")
                                     for partition_id, u in state.clients.items()}
        results["split"] = {"train": len(splits.train), "validation": len(splits.validation), "head": len(splits.head)}
        log.info(
            "round %d | global %.1f%% | probe %.1f%% (%+.1f pp) | realigned %.1f%% (%+.1f pp)",
            state.server_round, 100 * results["global"]["accuracy"], 100 * results["probe"]["accuracy"],
            100 * results["gaps"]["probe"], 100 * results["realigned"]["accuracy"], 100 * results["gaps"]["realigned"],
        )
        degenerate = [f"{key} (class {results[key]['max_predicted_class']}: "
                      f"{100 * results[key]['max_predicted_fraction']:.0f}%)" for key in degenerate_heads(results)]
        if degenerate:
            log.warning("round %d: degenerate head(s), one class for > %.0f%% of the test images: %s",
                        state.server_round, 100 * DEGENERATE_FRACTION, ", ".join(degenerate))
        return DiagnosticResult(metrics=results)

    def _probe(self, f_audit, y_audit, f_test, y_test, splits: _Splits, n: int, seed: int) -> dict[str, Any]:
        """A fresh linear classifier on standardised features, epoch selected on validation."""
        f_train = f_audit[splits.train]
        mean, std = f_train.mean(0), f_train.std(0)
        std = torch.where(std > 1e-6, std, torch.ones_like(std))  # constant features stay put
        norm = lambda f: (f - mean) / std  # noqa: E731
        zero = LinearHead(torch.zeros(n, f_audit.shape[1]), torch.zeros(n))
        snapshots = train_linear(norm(f_train), y_audit[splits.train], zero, self.params.probe,
                                 torch.Generator().manual_seed(seed))[1:]
        f_val, y_val = norm(f_audit[splits.validation]), y_audit[splits.validation]
        chosen = best_epoch(snapshots, f_val, y_val, n)
        return {
            **_scores(score(snapshots[chosen], norm(f_test), y_test, n)),
            "validation_accuracy": score(snapshots[chosen], f_val, y_val, n).accuracy,
            "epoch": chosen + 1,
        }

    def _client(self, model: FedMechModel, x_audit, y_audit, x_test, y_test, splits: _Splits, n: int, seed: int) -> dict[str, Any]:
        f_audit, f_test = features(model, x_audit), features(model, x_test)
        return {
            "own_head": _scores(score(LinearHead.of(model), f_test, y_test, n)),
            "probe": self._probe(f_audit, y_audit, f_test, y_test, splits, n, seed),
        }

    def _from_client_stats(self, state: RoundState, own: LinearHead, f_test, y_test) -> dict[str, Any]:
        parts = [
            ClassStats.from_arrays(load_bytes(u.global_diagnostics["misalignment"]["class_stats"]))
            for u in state.clients.values()
            if "class_stats" in u.global_diagnostics.get("misalignment", {})
        ]
        if not parts:
            log.warning("round %d: no client sent class statistics; ncm/ccvr skipped", state.server_round)
            return {}
        stats, n, out = ClassStats.sum(parts), state.num_classes, {}
        if "ncm" in self.params.client_stats:
            out["ncm"] = _scores(score(ncm_head(stats, own), f_test, y_test, n))
        if "ccvr" in self.params.client_stats:
            generator = torch_generator(state.seed, "misalignment-ccvr", None, state.server_round)
            head = ccvr_head(stats, own, self.params.ccvr_virtual_per_class, self.params.ccvr_train, generator)
            out["ccvr"] = _scores(score(head, f_test, y_test, n))
        for key in out:
            out[key]["clients"] = len(parts)
        return out

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        from fedmech_flwr.api import class_labels, heatmap, line_plot

        if not records:
            return []
        lines = {
            key.replace("_", " "): [(r["round"], r[key]["accuracy"]) for r in records if key in r]
            for key in CURVES
        }
        out = [line_plot({k: v for k, v in lines.items() if v}, "Global head vs linear probe vs realigned head",
                         "test accuracy", plots_dir / "misalignment_accuracy.png", (0.0, 1.0))]
        rounds = [r["round"] for r in records]
        for key in ("probe", "realigned"):
            gaps = np.array([[np.nan if g is None else g for g in r["per_class_gaps"][key]] for r in records]).T
            out.append(heatmap(gaps, rounds, class_labels(range(len(gaps)), class_names),
                               f"Per-class gap: {key} - global (test recall, as a fraction)",
                               plots_dir / f"misalignment_gap_{key}.png", vmin=-1.0, vmax=1.0, cmap="RdBu"))
        return out


def degenerate_heads(record: dict[str, Any]) -> list[str]:
    """The heads (``CURVES``) of a misalignment record that predict one class for more than
    ``DEGENERATE_FRACTION`` of the test images."""
    return [key for key in CURVES if record.get(key, {}).get("max_predicted_fraction", 0.0) > DEGENERATE_FRACTION]


def _scores(s: Scores) -> dict[str, Any]:
    return {"accuracy": s.accuracy, "per_class": s.per_class_accuracy, "max_predicted_class": s.max_predicted_class,
            "max_predicted_fraction": s.max_predicted_fraction}


def _class_gap(a: list[float | None], b: list[float | None]) -> list[float | None]:
    return [None if x is None or y is None else x - y for x, y in zip(a, b)]
