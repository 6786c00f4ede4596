"""The ``neural_collapse`` diagnostic: how far the global model's last-layer geometry is from
neural collapse (Papyan, Han and Donoho, PNAS 2020), every round, on the server's audit
images (held out from every client, never the test set).

With h_i the penultimate features of image i of class y_i (N images, C classes), mu_c the
mean of class c, mu_G the mean of all N (on the balanced audit set, the mean of the class
means), M the C centred class means mu_c - mu_G as rows, and W [C, d], b the classifier's
weight and bias, in Papyan et al.'s conventions:

- ``nc1`` (within-class variability collapses) = Tr(Sigma_W Sigma_B^+) / C, Sigma_W =
  mean_i (h_i - mu_{y_i})(h_i - mu_{y_i})^T, Sigma_B = mean_c (mu_c - mu_G)(mu_c - mu_G)^T,
  ^+ the pseudo-inverse on Sigma_B's top C - 1 directions (the rank of C centred means, as
  their code takes it). Within-class spread measured in units of the between-class one.
- NC2 (the class means form a simplex equiangular tight frame), of the centred class means
  and (``classifier_``) of the classifier's rows: ``equinorm`` = std_c ||m_c|| / mean_c
  ||m_c|| (coefficient of variation of the norms); ``equiangular`` = std over the pairs
  c < c' of cos(m_c, m_c'); ``max_angle`` = mean over the pairs of |cos(m_c, m_c') +
  1 / (C - 1)|, the distance from the simplex's cosine. Standard deviations are population
  ones (over all classes or pairs).
- ``nc3`` (self-duality: the classifier's rows align with the class means) =
  || W^T / ||W||_F - M^T / ||M||_F ||_F^2, between 0 (aligned) and 4. The misalignment lens
  without training anything: a head that drifts from its own features' class means.
- ``nc4`` (the classifier acts as the nearest class centre) = the share of audit images
  whose prediction argmax_c (W h + b)_c differs from argmin_c ||h - mu_c||.

All four are 0 at collapse, and the cosines -1/(C - 1): the values of a simplex ETF, which
FedETF's fixed head is by construction (``strategies/fedetf.py``), so under FedETF the
classifier's NC2 is 0 every round and the figures draw that ideal as their reference line.
Papyan et al. measure on the training set; here the features are the audit images', the
data the server holds. A value that needs a norm or a direction the features do not have
(every class mean at the centre) is null.

Cost: one forward pass of the global model (and of each client's model with ``clients``)
over the audit images. With ``clients`` on, 1,000 audit images and 10 clients at the
``cpu`` budget of ``experiments/paper/v2_misalignment.yaml`` on Fashion-MNIST, it took 0.22
to 0.30 of a round's local training on 2 shared CPU cores (``benchmarks/similarity_round.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmech_flwr.api import DataInfo, ExperimentConfig, Metric, Outputs
from fedmech_flwr.api._builtin import LinearHead, features
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, RoundState
from fedmech_flwr.api.model import FedMechModel

METRICS = ("nc1", "nc2_equinorm", "nc2_equiangular", "nc2_max_angle", "nc2_classifier_equinorm",
           "nc2_classifier_equiangular", "nc2_classifier_max_angle", "nc3", "nc4")
"""The keys of one model's record, every one 0 at collapse."""
FORWARD_BATCH = 128
"""Images per forward pass: on a CPU, SimpleCNN runs 2 to 3 times slower per image in
batches of 1,000 (its activations no longer fit the cache)."""


@dataclass
class NeuralCollapseConfig:
    clients: bool = False
    """Also measure every client's trained model (``clients``) and their mean
    (``clients_mean``)."""


def _norm_spread(rows: np.ndarray) -> float | None:
    """Coefficient of variation of the rows' norms."""
    norms = np.linalg.norm(rows, axis=1)
    return float(norms.std() / norms.mean()) if norms.mean() > 0 else None


def _cosines(rows: np.ndarray) -> np.ndarray | None:
    """Cosines of every pair of rows c < c'; None where a row is zero."""
    norms = np.linalg.norm(rows, axis=1)
    if not (norms > 0).all():
        return None
    unit = rows / norms[:, None]
    return (unit @ unit.T)[np.triu_indices(len(rows), 1)]


def _nc2(rows: np.ndarray, prefix: str) -> dict[str, float | None]:
    cosines = _cosines(rows)
    simplex = -1.0 / (len(rows) - 1)
    return {f"{prefix}equinorm": _norm_spread(rows),
            f"{prefix}equiangular": None if cosines is None else float(cosines.std()),
            f"{prefix}max_angle": None if cosines is None else float(np.abs(cosines - simplex).mean())}


def collapse(f: torch.Tensor, y: torch.Tensor, head: LinearHead, num_classes: int) -> dict[str, float | None]:
    """NC1 to NC4 (the module's docstring) of features ``f`` [N, d] with labels ``y`` (every
    class present) and the classifier ``head``, in float64."""
    h, labels = f.double().cpu().numpy(), y.cpu().numpy()
    w, b = head.weight.double().cpu().numpy(), head.bias.double().cpu().numpy()
    if set(np.unique(labels).tolist()) != set(range(num_classes)):
        raise ValueError(f"neural collapse needs every one of the {num_classes} classes, got {np.unique(labels)}")
    means = np.stack([h[labels == c].mean(0) for c in range(num_classes)])
    centred = means - h.mean(0)
    within = h - means[labels]
    _, s, vt = np.linalg.svd(centred, full_matrices=False)  # s descending
    rank = int(np.sum(s[: num_classes - 1] > 1e-12 * s[0])) if s[0] > 0 else 0
    # Tr(Sigma_W Sigma_B^+) / C = mean_i ||S^-1 V^T (h_i - mu_{y_i})||^2 over Sigma_B's top directions
    nc1 = float(np.mean(np.sum((within @ vt[:rank].T / s[:rank]) ** 2, axis=1))) if rank else None
    m_norm, w_norm = np.linalg.norm(centred), np.linalg.norm(w)
    nc3 = float(np.sum((w / w_norm - centred / m_norm) ** 2)) if m_norm > 0 and w_norm > 0 else None
    predicted = np.argmax(h @ w.T + b, axis=1)
    nearest = np.argmin(np.sum(means**2, axis=1) - 2 * h @ means.T, axis=1)  # ||h - mu_c||^2 less ||h||^2
    return {"nc1": nc1, **_nc2(centred, "nc2_"), **_nc2(w, "nc2_classifier_"), "nc3": nc3,
            "nc4": float(np.mean(predicted != nearest))}


def model_collapse(model: FedMechModel, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, float | None]:
    """``collapse`` of a model's penultimate features on ``(x, y)`` and its own head."""
    return collapse(features(model, x, batch_size=FORWARD_BATCH), y, LinearHead.of(model), num_classes)


def _metric(label: str, key: str, unit: str = "ratio", path: str = "global", doc: str = "") -> Metric:
    return Metric(label, (path, key), unit, 3 if unit != "%" else 1, better="lower", doc=doc)


OUTPUTS = Outputs("Neural collapse of the global model (neural_collapse diagnostic)", {
    "nc1": _metric("NC1 within-class variability", "nc1",
                   doc="spread of the features inside each class, in units of the spread between classes (0: collapsed)"),
    "nc2_equinorm": _metric("NC2 class-mean norms, CV", "nc2_equinorm"),
    "nc2_max_angle": _metric("NC2 class-mean cosines, from -1/(C-1)", "nc2_max_angle"),
    "nc2_classifier_max_angle": _metric("NC2 classifier cosines, from -1/(C-1)", "nc2_classifier_max_angle"),
    "nc3": _metric("NC3 classifier vs class means", "nc3",
                   doc="how far the classifier's rows are from its own features' class means (0: aligned; 4 at most)"),
    "nc4": _metric("NC4 classifier vs nearest class mean", "nc4", "%",
                   doc="share of audit images the classifier labels unlike the nearest class mean"),
    "clients_mean.nc3": _metric("NC3 classifier vs class means, clients' mean", "nc3", path="clients_mean"),
}, curves=("nc1", "nc2_max_angle", "nc3", "nc4"), headline=("nc1", "nc3"))
"""The global model's NC1 to NC4 (every one 0 at collapse), and the clients' mean NC3 when
``clients`` is on."""


def check_collapse(params: NeuralCollapseConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """The class means are measured on the audit set."""
    data.require_audit("neural_collapse measures the class means of the features on", where, suggested=100)


@DIAGNOSTICS.register("neural_collapse", NeuralCollapseConfig, check=check_collapse, outputs=OUTPUTS)
class NeuralCollapse(Diagnostic):
    """NC1 to NC4 of the global model (and optionally each client model) on the audit images."""

    def server_side(self, state: RoundState) -> DiagnosticResult:
        x, y = state.datasets["audit"]
        n = state.num_classes
        record: dict[str, Any] = {"global": model_collapse(state.build_model(state.global_arrays), x, y, n),
                                  "images": len(y)}
        if self.params.clients:
            clients = {str(pid): model_collapse(state.build_model(u.arrays), x, y, n) for pid, u in state.clients.items()}
            record["clients"] = clients
            record["clients_mean"] = {key: float(np.mean(values)) if (values := [c[key] for c in clients.values()
                                                                                 if c[key] is not None]) else None
                                      for key in METRICS}
        return DiagnosticResult(metrics=record)

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        from fedmech_flwr.api._builtin import save_figure

        if not records:
            return []
        panels = {
            "NC1: Tr(Σ_W Σ_B⁺) / C": {"class means": "nc1"},
            "NC2: distance from a simplex ETF": {
                "class-mean norms, CV": "nc2_equinorm", "class-mean cosines, mean |cos + 1/(C-1)|": "nc2_max_angle",
                "classifier norms, CV": "nc2_classifier_equinorm",
                "classifier cosines, mean |cos + 1/(C-1)|": "nc2_classifier_max_angle"},
            "NC3: ‖Wᵀ/‖W‖ − Mᵀ/‖M‖‖²": {"classifier vs class means": "nc3"},
            "NC4: classifier ≠ nearest class mean": {"share of audit images": "nc4"},
        }
        sources = {"global model": "global", **({"clients' mean": "clients_mean"} if "clients_mean" in records[-1] else {})}
        fig = Figure(figsize=(11, 7), layout="constrained")
        for ax, (title, series) in zip(fig.subplots(2, 2).flat, panels.items()):
            for source, key in sources.items():
                for colour, (label, metric) in enumerate(series.items()):
                    points = [(r["round"], r[key][metric]) for r in records if r.get(key, {}).get(metric) is not None]
                    if points:
                        ax.plot(*zip(*points), marker="o", markersize=3, color=f"C{colour}",
                                linestyle="-" if key == "global" else ":", label=f"{source}: {label}")
            ax.axhline(0.0, color="black", linestyle="--", linewidth=1,
                       label="simplex ETF, the ideal (FedETF's fixed head)")
            ax.set(title=title, xlabel="round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("Neural collapse on the audit images (0 everywhere at collapse)")
        return [save_figure(fig, plots_dir / "neural_collapse.png")]
