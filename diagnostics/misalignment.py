"""The ``misalignment`` diagnostic: are the global model's features preserved while its head
stops reading them? (arXiv 2512.23043, later version)

Every due round it puts side by side, on the test set, overall and per class:

- ``global``: the global model as it is (its own head);
- ``probe``: a fresh linear classifier on the global model's frozen penultimate features
  (standardised), trained on the audit set's training split, epoch selected on its
  validation split: how much class information the features still carry;
- ``probe_pooled`` (``pooled_probe``): the same question asked with every client's training
  shard pooled (the paper's probe), a simulation-only oracle: no real federation's server
  holds its clients' data. ``selected`` trains it like ``probe``, with its epoch picked on a
  held-out part of the pooled data; ``paper`` repeats the authors' probe (their
  ``analysis/train_probes.py``: Adam lr 1e-4, 50 epochs, batch 128, raw features, PyTorch's
  default initialisation, the last epoch);
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

Every probe record carries its learning curve: its test accuracy trained on a quarter, a
half and all of its training data (nested, class-stratified subsets). A probe whose last
doubling still gains more than ``UNDER_POWERED_GAIN`` is ``under_powered``, flagged
wherever its value is shown: it measures how much its data can teach a linear layer as
much as what the features carry.

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

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, Metric, Outputs, seed_for, torch_generator
from fedmech_flwr.api._builtin import (
    DEGENERATE_FRACTION,
    ClassStats,
    Clock,
    Covariance,
    LinearHead,
    LinearTrainConfig,
    Scores,
    balanced_split,
    best_epoch,
    ccvr_head,
    ccvr_train_config,
    class_stats,
    either,
    features,
    features_at,
    head_set_per_class,
    ncm_head,
    one_class,
    score,
    tau_normalize,
    train_linear,
    under_powered,
)
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, GlobalContext, RoundState
from fedmech_flwr.api.model import FedMechModel

log = logging.getLogger(__name__)

CURVES = ("global", "probe", "probe_pooled", "realigned", "realigned_test_selected", "tau_norm", "ncm", "ccvr")
PROBES = ("probe", "probe_pooled")
"""The linear probes, each with its learning curve."""
LEARNING_CURVE = (0.25, 0.5, 1.0)
"""Shares of a probe's training data its learning curve is measured at."""
UNDER_POWERED_GAIN = 0.01
"""A probe whose test accuracy gains more than this (1 point) from its last doubling of
training data is under-powered."""
PAPER_PROBE = LinearTrainConfig(epochs=50, batch_size=128, lr=1e-4, weight_decay=0.0, schedule="constant")
"""The authors' probe optimiser (Adam, i.e. AdamW without weight decay, constant rate)."""
POOLED_NOTE = ("trained on every client's training shard pooled: a simulation-only oracle, which no real "
               "federation's server holds")


@dataclass
class MisalignmentConfig:
    validation_fraction: float = field(default=0.2, metadata={"gt": 0.0, "lt": 1.0})
    """Share of each audit class that selects epochs; the rest is the training split."""
    probe: LinearTrainConfig = field(
        default_factory=lambda: LinearTrainConfig(epochs=50, batch_size=64, lr=1e-2, weight_decay=1e-3)
    )
    """How the linear probe is trained (from zero weights, on standardised features)."""
    pooled_probe: Literal["none", "selected", "paper"] = "none"
    """Also probe with every client's training shard pooled (``probe_pooled``, the paper's
    probe; simulation only): ``selected`` trains it with ``pooled_train``, epoch picked on
    ``pooled_validation_fraction`` of the pooled data; ``paper`` repeats the authors' probe
    (Adam lr 1e-4, 50 epochs, batch 128, raw features, the last epoch)."""
    pooled_validation_fraction: float = field(default=0.1, metadata={"gt": 0.0, "lt": 1.0})
    """Share of the pooled data held out to select the ``selected`` probe's epoch."""
    pooled_train: LinearTrainConfig = field(
        default_factory=lambda: LinearTrainConfig(epochs=20, batch_size=1024, lr=3e-3, weight_decay=1e-4)
    )
    """How the ``selected`` pooled probe is trained (from zero weights, on standardised
    features): large batches, since tens of thousands of images make a step cheap to
    average and costly to take one at a time."""
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
    flag = either(one_class((key,)), under_powered((key,))) if key in PROBES else one_class((key,))
    return Metric(label, (key, "accuracy"), "%", better="higher", per_class=(key, "per_class"), flag=flag, doc=doc)


def _gap(label: str, key: str, path: tuple[str, ...], per_class: tuple[str, ...]) -> Metric:
    flag = one_class(("global",), (key,))
    return Metric(label, path, "pp", per_class=per_class,
                  flag=either(flag, under_powered((key,))) if key in PROBES else flag)


OUTPUTS = Outputs(
    "Preserved or misaligned (misalignment diagnostic)",
    {"global": _head("global", "global", "global model"),
     "probe": _head("probe", "probe", "linear probe on its frozen features"),
     "probe_pooled": _head("pooled-data probe", "probe_pooled",
                           "linear probe on its frozen features, trained on every client's data pooled "
                           "(simulation only)"),
     "realigned": _head("realigned (val-selected)", "realigned", "its head retrained alone"),
     "realigned_test_selected": _head("realigned (test-selected)", "realigned_test_selected"),
     "ncm": _head("NCM", "ncm"), "ccvr": _head("CCVR", "ccvr"), "tau_norm": _head("tau-norm", "tau_norm"),
     "gaps.probe": _gap("probe − global", "probe", ("gaps", "probe"), ("per_class_gaps", "probe")),
     "gaps.probe_pooled": _gap("pooled probe − global", "probe_pooled", ("probe_pooled", "gap"),
                               ("probe_pooled", "per_class_gap")),
     "gaps.realigned": _gap("realigned − global", "realigned", ("gaps", "realigned"),
                            ("per_class_gaps", "realigned"))},
    curves=("gaps.probe", "gaps.probe_pooled"), headline=("probe", "gaps.probe", "probe_pooled", "gaps.probe_pooled"),
    by_skew=("global", "probe", "probe_pooled", "realigned"))
"""Every head's accuracy (one-class heads and under-powered probes flagged) and the gaps the
paper's claim is about."""


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

    def needs_pooled_data(self) -> bool:
        return self.params.pooled_probe != "none"

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
        if p.pooled_probe != "none":
            results["probe_pooled"] = self._pooled_probe(state, model, f_test, y_test, probe_seed)
        clock.lap("probe_pooled")

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
            "note": "epoch selected on the test set (the paper's texts state no selection rule); not a held-out number",
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
        if pooled := results.get("probe_pooled"):  # its own record holds its gap: absent where it did not run
            pooled["gap"] = pooled["accuracy"] - results["global"]["accuracy"]
            pooled["per_class_gap"] = _class_gap(pooled["per_class"], results["global"]["per_class"])
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
        """The audit probe: a fresh linear classifier on the audit training split, epoch
        selected on its validation split, with its learning curve."""
        return fit_probe(f_audit[splits.train], y_audit[splits.train], f_audit[splits.validation],
                         y_audit[splits.validation], f_test, y_test, n, self.params.probe, seed)

    def _pooled_probe(self, state: RoundState, model: FedMechModel, f_test, y_test, seed: int) -> dict[str, Any]:
        """The probe on every client's training shard pooled (``pooled_probe``), features
        computed in chunks."""
        if "pooled" not in state.datasets:
            raise ConfigError("pooled_probe needs every client's training data on the server, which only a "
                              "`fedmech run` simulation (or `fedmech diagnose`) holds; set pooled_probe: none",
                              "misalignment.pooled_probe")
        x, y = state.datasets["pooled"]
        f = features(model, x)
        n, p = state.num_classes, self.params
        if p.pooled_probe == "paper":
            record = fit_probe(f, y, None, None, f_test, y_test, n, PAPER_PROBE, seed, standardise=False)
        else:
            generator = torch_generator(state.seed, "misalignment-pooled-split", None, state.server_round)
            order = torch.randperm(len(y), generator=generator)
            held = order[: max(1, int(round(p.pooled_validation_fraction * len(y))))]
            kept = order[len(held):].sort().values
            record = fit_probe(f[kept], y[kept], f[held], y[held], f_test, y_test, n, p.pooled_train, seed)
        return {**record, "recipe": p.pooled_probe, "samples": len(y), "note": POOLED_NOTE}

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
        from fedmech_flwr.api._builtin import class_labels
        from fedmech_flwr.api.diagnostic import heatmap, line_plot

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


def fit_probe(f_train, y_train, f_val, y_val, f_test, y_test, n: int, cfg: LinearTrainConfig, seed: int,
              standardise: bool = True) -> dict[str, Any]:
    """A fresh linear probe on ``(f_train, y_train)`` scored on the test set, with its
    learning curve (``LEARNING_CURVE``: nested, class-stratified shares of the training
    data, each trained alike) and whether it is ``under_powered``.

    With a validation set: standardised features, zero initial weights, the epoch with the
    best validation accuracy. Without one (the authors' probe): PyTorch's default
    initialisation (seeded) and the last epoch. The full-data probe is the recorded one."""
    subsets = _nested_shares(y_train, LEARNING_CURVE, torch.Generator().manual_seed(seed))
    fits = [_fit(f_train[idx], y_train[idx], f_val, y_val, f_test, y_test, n, cfg, seed, standardise)
            for idx in subsets[:-1]]
    fits.append(_fit(f_train, y_train, f_val, y_val, f_test, y_test, n, cfg, seed, standardise))
    accuracy = [fit["accuracy"] for fit in fits]
    return {**fits[-1], "learning_curve": {"samples": [len(idx) for idx in subsets], "accuracy": accuracy},
            "under_powered": accuracy[-1] - accuracy[-2] > UNDER_POWERED_GAIN}


def _nested_shares(y: torch.Tensor, shares: Sequence[float], generator: torch.Generator) -> list[torch.Tensor]:
    """Indices of ``shares`` of ``y``, each subset inside the next and every class in the same
    proportion (at least one sample of each class present)."""
    order = torch.randperm(len(y), generator=generator)
    by_class = [order[y[order] == c] for c in torch.unique(y).tolist()]
    return [torch.cat([idx[: max(1, int(round(share * len(idx))))] for idx in by_class]).sort().values
            for share in shares]


def _fit(f_train, y_train, f_val, y_val, f_test, y_test, n: int, cfg: LinearTrainConfig, seed: int,
         standardise: bool) -> dict[str, Any]:
    """One probe (see ``fit_probe``): its test scores, and its epoch and validation accuracy
    where a validation set selected it."""
    if standardise:
        mean, std = f_train.mean(0), f_train.std(0)
        std = torch.where(std > 1e-6, std, torch.ones_like(std))  # constant features stay put
        norm = lambda f: (f - mean) / std  # noqa: E731
    else:
        norm = lambda f: f  # noqa: E731  (raw features: no copy of tens of thousands of rows)
    if f_val is None:  # PyTorch's default nn.Linear initialisation, from the seed, not the process's generator
        generator, bound = torch.Generator().manual_seed(seed), 1 / f_train.shape[1] ** 0.5
        weight = torch.nn.init.kaiming_uniform_(torch.empty(n, f_train.shape[1]), a=5 ** 0.5, generator=generator)
        start = LinearHead(weight, torch.nn.init.uniform_(torch.empty(n), -bound, bound, generator=generator))
    else:
        start = LinearHead(torch.zeros(n, f_train.shape[1]), torch.zeros(n))
    snapshots = train_linear(norm(f_train), y_train, start, cfg, torch.Generator().manual_seed(seed))[1:]
    if f_val is None:
        return _scores(score(snapshots[-1], norm(f_test), y_test, n))
    f_val = norm(f_val)
    chosen = best_epoch(snapshots, f_val, y_val, n)
    return {**_scores(score(snapshots[chosen], norm(f_test), y_test, n)),
            "validation_accuracy": score(snapshots[chosen], f_val, y_val, n).accuracy, "epoch": chosen + 1}


def degenerate_heads(record: dict[str, Any]) -> list[str]:
    """The heads (``CURVES``) of a misalignment record that predict one class for more than
    ``DEGENERATE_FRACTION`` of the test images."""
    return [key for key in CURVES if record.get(key, {}).get("max_predicted_fraction", 0.0) > DEGENERATE_FRACTION]


def _scores(s: Scores) -> dict[str, Any]:
    return {"accuracy": s.accuracy, "per_class": s.per_class_accuracy, "max_predicted_class": s.max_predicted_class,
            "max_predicted_fraction": s.max_predicted_fraction}


def _class_gap(a: list[float | None], b: list[float | None]) -> list[float | None]:
    return [None if x is None or y is None else x - y for x, y in zip(a, b)]
