"""The ``usae`` diagnostic: every N rounds, one universal SAE over the global model and
each client's model (``compare: clients``) or the global model and a fixed reference
model (``compare: reference``, e.g. an IID run's final model), at one gated layer.

Runs on the server on the audit set when the run has one (``data.audit_per_class``),
else on the test set (recorded as ``data``). Records the R^2 matrix, sparsity, shared /
unique concept counts and overlap (fires at least once: the project's reading of the paper, which states no rule; a firing threshold and the calibrated
rule), stitching, and ``fit`` (false when a model's self-reconstruction R^2 is below
``FIT_R2``; see ``diagnostics.usae.analysis``); stores the dictionary (``usae_arrays``
under ``usae/``: ``load_usae`` reads them without the prefix) and the concept firing
frequencies as arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, Metric, Outputs
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, RoundState

from .analysis import CpuUSAEConfig, analyse, overlap_summary
from .model import usae_arrays
from .sources import load_source_model, parse_source

log = logging.getLogger(__name__)


@dataclass
class UsaeDiagnosticConfig:
    layer: str
    """Gated layer whose activations are compared, e.g. conv2."""
    usae: CpuUSAEConfig = field(default_factory=CpuUSAEConfig)
    """Dictionary size and training (CPU defaults: expansion 4, k 16, 10 epochs, at least 1,000 steps)."""
    compare: Literal["clients", "reference"] = "clients"
    """The global model against every client's model of the round, or against ``reference``."""
    reference: str | None = None
    """With compare: reference: a run folder, RUN_DIR@ROUND or CONFIG.yaml:WEIGHTS.safetensors
    (same dataset as this run)."""
    max_images: int = field(default=2000, metadata={"ge": 1})
    """Images taken from the audit (else test) set."""
    threshold: float = field(default=0.01, metadata={"ge": 0.0, "lt": 1.0})
    """Firing frequency above which a concept counts as active (reported besides > 0)."""


def check_usae(params: UsaeDiagnosticConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """``compare: reference`` needs the reference to compare with."""
    if params.compare == "reference" and not params.reference:
        raise ConfigError(
            f"compare: reference needs reference: RUN_DIR or CONFIG.yaml:WEIGHTS, got {params.reference!r}",
            f"{where}.reference",
        )


def not_fit(record: dict[str, Any]) -> str | None:
    """Flag a USAE whose dictionary does not reconstruct its models (``fit`` false)."""
    return "USAE not fit" if record.get("fit") is False else None


OUTPUTS = Outputs("Universal SAE (usae diagnostic)", {
    "shared_of_dictionary": Metric("shared concepts / dictionary size (fires once)",
                                   ("overlap", "fires_once", "shared"), "%", per=("dict_size",), flag=not_fit),
    "overlap": Metric("shared / alive concepts (fires once; the project's rule)",
                      ("overlap", "fires_once", "overlap"), "%", flag=not_fit),
    "overlap_thresholded": Metric("shared / alive concepts (above threshold; the project's rule)",
                                  ("overlap", "thresholded", "overlap"), "%", flag=not_fit),
    "r2_cross_mean": Metric("mean cross reconstruction", ("r2_cross_mean",), "R^2", 2, better="higher", flag=not_fit),
}, headline=("overlap",))
"""Concept overlap under the project's rules (the paper's texts state none) and how well
the shared dictionary reconstructs across models; all flagged when the USAE did not fit."""


@DIAGNOSTICS.register("usae", UsaeDiagnosticConfig, check=check_usae, outputs=OUTPUTS)
class Usae(Diagnostic):
    """Shared and unique concepts of the global and the clients' (or a reference) models."""

    def __init__(self, params: UsaeDiagnosticConfig) -> None:
        super().__init__(params)
        self._reference = None

    def _models(self, state: RoundState):
        models = [state.build_model(state.global_arrays)]
        names = ["global"]
        if self.params.compare == "reference":
            if self._reference is None:
                source = parse_source(self.params.reference)
                self._reference = (source.name, load_source_model(source, state.device))
            names.append(f"reference {self._reference[0]}")
            models.append(self._reference[1])
        else:
            for partition_id, update in state.clients.items():
                models.append(state.build_model(update.arrays))
                names.append(f"client {partition_id}")
        return models, names

    def server_side(self, state: RoundState) -> DiagnosticResult:
        p = self.params
        split = "audit" if "audit" in state.datasets else "test"
        x, y = state.datasets[split]
        x, y = x[: p.max_images], y[: p.max_images]
        models, names = self._models(state)
        usae, metrics = analyse(models, names, p.layer, x, y, p.usae, state.device, p.threshold)
        r2 = metrics["r2_cross_mean"]
        log.info("round %d | usae at %s | cross R^2 %s | %s", state.server_round, p.layer,
                 "n/a" if r2 is None else f"{r2:.3f}", overlap_summary(metrics["overlap"]))
        activity = np.asarray(metrics.pop("activity"), dtype=np.float32)
        metrics["data"] = {"split": split, "num_images": len(x)}
        metrics["compare"] = p.compare
        arrays = {f"usae/{name}": a for name, a in usae_arrays(usae).items()}
        return DiagnosticResult(metrics=metrics, arrays={**arrays, "activity": activity})

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        from fedmech_flwr.api.diagnostic import line_plot

        if not records:
            return []
        overlap = {
            f"shared / alive ({label})": [(r["round"], r["overlap"][key]["overlap"]) for r in records
                                          if r["overlap"].get(key, {}).get("overlap") is not None]
            for key, label in (("fires_once", "fires at least once, the project's reading of the paper"),
                               ("thresholded", "frequency > threshold"),
                               ("calibrated", "calibrated: rare unique concepts set apart"))
        }
        r2 = {
            label: [(r["round"], r[key]) for r in records if r[key] is not None]
            for key, label in (("r2_cross_mean", "mean cross R^2 (i != j)"), ("r2_self_mean", "mean self R^2"))
        }
        out = []
        overlap = {k: v for k, v in overlap.items() if v}
        if overlap:
            out.append(line_plot(overlap, "USAE concept overlap over rounds", "shared / alive concepts",
                                 plots_dir / "usae_overlap.png", (0.0, 1.05)))
        r2 = {k: v for k, v in r2.items() if v}
        if r2:
            out.append(line_plot(r2, f"USAE reconstruction at {records[-1]['layer']} over rounds", "R^2",
                                 plots_dir / "usae_r2.png"))
        return out
