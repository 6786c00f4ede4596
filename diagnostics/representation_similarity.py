"""The ``representation_similarity`` diagnostic: where, layer by layer, do this round's
client models disagree? (CCVR's lens: Luo et al., NeurIPS 2021, found the classifier the
least similar layer across clients under non-IID data.)

Linear CKA (centered kernel alignment, Kornblith et al., ICML 2019) of two representations
X [n, p] and Y [n, q] of the same n images, with K = X X^T and L = Y Y^T their Gram
matrices:

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))

- ``biased``: HSIC(K, L) = <H K H, H L H> / (n - 1)^2, H = I - 1 1^T / n (Gretton et al.
  2005), Kornblith et al.'s estimator. It is biased upwards when the width is not small
  against n: two independent random representations of 1,000 images, each 1,000 wide,
  score about 0.5 (debiased, about 0).
- ``debiased`` (the default): the unbiased HSIC estimator of Song et al. (JMLR 2012),
  HSIC_1(K, L) = <U(K), U(L)> / (n (n - 3)), U the U-centring of a Gram matrix (diagonal
  zeroed; off the diagonal K_ij minus its row and column sums over n - 2, plus the total
  over (n - 1)(n - 2)), as in Nguyen, Raghu and Kornblith (ICLR 2021) and Kornblith's code.
  Needs n >= 4; a debiased CKA can be slightly negative.

CKA is 1 for a representation and itself, invariant to orthogonal transforms and isotropic
scaling of either side (not to other linear maps), and of 1-D representations the squared
Pearson correlation. A representation that is the same for every image has no CKA (null).

Layers: every gated layer's output (average-pooled over space, as the probes read it),
``penultimate`` (the features the head reads) and ``head`` (the logits). Every round, on
the server's audit images (``images_per_class`` of each class at most; never the test
set), between every pair of this round's client models and between each client model and
the new global model, it records per layer the mean and min client-client CKA and the mean
client-global CKA, the least similar layer (lowest mean client-client CKA) and whether it
is the head; the arrays hold every layer's (clients + 1) x (clients + 1) matrix, global
last, and the record the matrix of ``matrix_layer``.

Cost: on Fashion-MNIST at the ``cpu`` budget of ``experiments/paper/v2_misalignment.yaml``
(10 clients, 2 local epochs on 1,000 samples, SimpleCNN [32, 64, 128]) on 2 CPU cores
shared with other work, one round's similarity on 500 audit images (the default 50 a
class) took 0.07 to 0.18 of that round's local training (4 rounds), and on 1,000 (100 a
class) 0.23 to 0.31 (``benchmarks/similarity_round.py``): mostly the forward pass of the
eleven models, then the Gram matrices.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedmech_flwr.api import ConfigError, DataInfo, ExperimentConfig, Metric, Outputs, torch_generator
from fedmech_flwr.api._builtin import Clock, balanced_split, features_at
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult, RoundState
from fedmech_flwr.api.model import FedMechModel, build_model

log = logging.getLogger(__name__)

PENULTIMATE, HEAD = "penultimate", "head"
"""The two layers every model has besides its gated ones: the features the head reads, and
the logits."""
Estimator = Literal["debiased", "biased"]
FORWARD_BATCH = 128
"""Images per forward pass: on a CPU, SimpleCNN runs 2 to 3 times slower per image in
batches of 1,000 (its activations no longer fit the cache)."""


@dataclass
class RepresentationSimilarityConfig:
    layers: list[str] | None = None
    """Layers to compare (in forward order, whatever the order here): gated layers by name,
    ``penultimate`` and ``head`` (the logits); null: every gated layer, then ``penultimate``
    and ``head``."""
    matrix_layer: str = HEAD
    """The layer whose client x client CKA matrix the record holds and the figures draw
    (the arrays hold every layer's)."""
    estimator: Estimator = "debiased"
    """``debiased`` (Song et al.'s unbiased HSIC) or ``biased`` (Kornblith et al.'s)."""
    images_per_class: int = field(default=50, metadata={"ge": 1})
    """Audit images per class compared, at most (a seeded balanced subset when the audit
    set holds more). The cost grows with them: a forward pass of every model over them,
    and every model's n x n Gram matrix of a layer, held at once."""


def centred_gram(x: torch.Tensor, estimator: Estimator) -> torch.Tensor:
    """The Gram matrix of the rows of ``x`` [n, d], double-centred (``biased``) or
    U-centred (``debiased``), in float64 (the product itself in ``x``'s precision: float32
    from a model, half the time)."""
    x = x.flatten(1)
    x = (x.double() - x.double().mean(0)).to(x.dtype)  # leaves either centring unchanged, keeps the Gram small
    gram = (x @ x.T).double()
    if estimator == "biased":
        return gram  # = H K H: the columns are centred
    n = len(gram)
    gram.fill_diagonal_(0.0)
    means = gram.sum(0) / (n - 2)
    means -= means.sum() / (2 * (n - 1))
    gram -= means[:, None] + means[None, :]
    return gram.fill_diagonal_(0.0)


def hsic(x: torch.Tensor, y: torch.Tensor, estimator: Estimator) -> float:
    """HSIC of the linear kernels of ``x`` and ``y`` (rows the same samples): the biased
    estimator or Song et al.'s unbiased one (see the module's docstring)."""
    n = len(x)
    scale = (n - 1) ** 2 if estimator == "biased" else n * (n - 3)
    return float((centred_gram(x, estimator) * centred_gram(y, estimator)).sum() / scale)


def cka_matrix(xs: Sequence[torch.Tensor], estimator: Estimator) -> np.ndarray:
    """Linear CKA between every pair of representations ``xs`` (each [n, d_i], rows the same
    samples) [M, M]; NaN where a representation is constant over the samples."""
    if estimator == "debiased" and len(xs[0]) < 4:
        raise ValueError(f"debiased CKA needs at least 4 samples, got {len(xs[0])}")
    grams = []
    for x in xs:
        gram = centred_gram(x, estimator).flatten()
        norm = gram.norm()
        grams.append(gram / norm if norm > 0 else torch.full_like(gram, float("nan")))
    stacked = torch.stack(grams)
    return (stacked @ stacked.T).numpy()


def cka(x: torch.Tensor, y: torch.Tensor, estimator: Estimator) -> float:
    """Linear CKA of two representations of the same samples (see ``cka_matrix``)."""
    return float(cka_matrix([x, y], estimator)[0, 1])


def check_similarity(params: RepresentationSimilarityConfig, cfg: ExperimentConfig, data: DataInfo, where: str) -> None:
    """It compares on the audit set, at least 4 images for the debiased estimator, and the
    layers it names must be the model's."""
    data.require_audit("representation_similarity compares the models' representations on", where, suggested=100)
    n = min(params.images_per_class, data.audit_per_class) * data.num_classes
    if params.estimator == "debiased" and n < 4:
        raise ConfigError(f"the debiased estimator needs at least 4 images, but {n} are compared; raise "
                          "images_per_class or data.audit_per_class, or set estimator: biased",
                          f"{where}.images_per_class")
    named = [*(params.layers or []), params.matrix_layer]
    if params.layers == [] or any(layer not in (PENULTIMATE, HEAD) for layer in named):
        with torch.random.fork_rng(devices=[]):  # a check leaves the caller's random state alone
            model = build_model(cfg.model.name, cfg.model.params, in_channels=data.input_shape[0],
                                num_classes=data.num_classes, image_size=data.input_shape[1])
        valid = all_layers(model)
        unknown = [layer for layer in named if layer not in valid]
        if unknown or params.layers == []:
            raise ConfigError(f"unknown layer(s) {unknown or '(none given)'}; model '{cfg.model.name}' has: "
                              f"{', '.join(valid)} (null: all of them)", f"{where}.layers")
        if params.layers is not None and params.matrix_layer not in params.layers:
            raise ConfigError(f"matrix_layer '{params.matrix_layer}' is not one of the compared layers "
                              f"{params.layers}; add it to layers or choose one of them", f"{where}.matrix_layer")


def all_layers(model: FedMechModel) -> list[str]:
    """Every layer this diagnostic can compare, in forward order."""
    return [*model.gated_layers(), PENULTIMATE, HEAD]


def representations(model: FedMechModel, x: torch.Tensor, layers: Sequence[str]) -> dict[str, torch.Tensor]:
    """``layers`` of ``model`` on images ``x``, each [n, d] (gated layers average-pooled),
    from one forward pass."""
    gated = [layer for layer in layers if layer not in (PENULTIMATE, HEAD)]
    penultimate, at = features_at(model, x, gated, FORWARD_BATCH)
    with torch.no_grad():
        at[PENULTIMATE], at[HEAD] = penultimate, model.forward_head(penultimate).float()
    return {layer: at[layer].cpu() for layer in layers}


OUTPUTS = Outputs("Layer similarity across clients (representation_similarity diagnostic)", {
    "client_client.head": Metric("client-client CKA, head (logits)", ("client_client", HEAD), "CKA", 3,
                                 doc="how alike the clients' models' logits are on the audit images (1: identical "
                                     "up to rotation and scale)"),
    "client_client.penultimate": Metric("client-client CKA, penultimate", ("client_client", PENULTIMATE), "CKA", 3),
    "client_global.head": Metric("client-global CKA, head (logits)", ("client_global", HEAD), "CKA", 3),
    "least_similar.cka": Metric("client-client CKA, least similar layer", ("least_similar", "cka"), "CKA", 3),
    "head_least_similar": Metric("head is the least similar layer", ("head_least_similar",), "share", 2,
                                 doc="1 when the clients disagree most at the head (CCVR's finding under label "
                                     "skew); its mean over seeds is the share of seeds where they do"),
}, curves=("client_client.head", "client_client.penultimate", "client_global.head", "least_similar.cka"),
    headline=("client_client.head", "head_least_similar"))
"""Per-layer values of the gated layers are in the record (``client_client``,
``client_client_min``, ``client_global``) and its figures; these are the layers every
model has, the least similar layer, and whether it is the head."""


@DIAGNOSTICS.register("representation_similarity", RepresentationSimilarityConfig, check=check_similarity,
                      outputs=OUTPUTS)
class RepresentationSimilarity(Diagnostic):
    """Linear CKA per layer between the round's client models, and each with the global model."""

    def server_side(self, state: RoundState) -> DiagnosticResult:
        p, clock = self.params, Clock()
        if not state.clients:
            log.warning("round %d: no client models to compare (a finished run's folder keeps none, so `fedmech "
                        "diagnose` cannot rerun representation_similarity); only the global model is recorded",
                        state.server_round)
        x, y = state.datasets["audit"]
        per_class = min(p.images_per_class, len(y) // state.num_classes)
        if per_class * state.num_classes < len(y):
            picked, _ = balanced_split(y, per_class, state.num_classes,
                                       torch_generator(state.seed, "similarity-images", None, state.server_round))
            x = x[picked]
        models = {**{str(pid): update.arrays for pid, update in state.clients.items()}, "global": state.global_arrays}
        layers = [layer for layer in all_layers(state.build_model(state.global_arrays))
                  if p.layers is None or layer in p.layers]
        reps = {label: representations(state.build_model(arrays), x, layers) for label, arrays in models.items()}
        clock.lap("features")
        matrices = {layer: cka_matrix([reps[label][layer] for label in models], p.estimator) for layer in layers}
        clock.lap("cka")
        clients = len(state.clients)
        pairs = np.triu_indices(clients, 1)

        def summary(values: np.ndarray, reduce) -> float | None:
            values = values[np.isfinite(values)]
            return float(reduce(values)) if len(values) else None

        client_client = {layer: summary(m[:clients, :clients][pairs], np.mean) for layer, m in matrices.items()}
        client_client_min = {layer: summary(m[:clients, :clients][pairs], np.min) for layer, m in matrices.items()}
        defined = {layer: v for layer, v in client_client.items() if v is not None}
        least = min(defined, key=defined.get) if defined else None
        record = {
            "estimator": p.estimator, "images": len(x), "clients": clients, "layers": layers,
            "client_client": client_client, "client_client_min": client_client_min,
            "client_global": {layer: summary(m[:clients, -1], np.mean) for layer, m in matrices.items()},
            "undefined": {layer: int(np.isnan(m[np.triu_indices(clients + 1, 1)]).sum()) for layer, m in matrices.items()},
            "least_similar": {"layer": least, "cka": defined.get(least)},
            "head_least_similar": None if least is None or HEAD not in layers else float(least == HEAD),
            "matrix": {"layer": p.matrix_layer, "rows": list(models),
                       "cka": [[round(float(v), 4) if np.isfinite(v) else None for v in row]
                               for row in matrices[p.matrix_layer]]},
            "server_seconds": clock.laps,
        }
        arrays = {f"cka.{layer}": m for layer, m in matrices.items()}
        arrays["partition_ids"] = np.array(list(state.clients), dtype=np.int64)
        return DiagnosticResult(metrics=record, arrays=arrays)

    @classmethod
    def plot(cls, records: list[dict[str, Any]], plots_dir: Path, class_names: Sequence[str] | None) -> list[Path]:
        from matplotlib.figure import Figure

        from fedmech_flwr.api._builtin import save_figure
        from fedmech_flwr.api.diagnostic import heatmap, line_plot

        if not records:
            return []
        last = records[-1]
        estimator = f"linear CKA, {last['estimator']}"
        fig = Figure(figsize=(7.5, 4.2), layout="constrained")
        ax = fig.subplots()
        depth = range(len(last["layers"]))
        for key, label, style in (("client_client", "client-client, mean", "-"),
                                  ("client_client_min", "client-client, min", ":"),
                                  ("client_global", "client-global, mean", "--")):
            values = [np.nan if last[key][layer] is None else last[key][layer] for layer in last["layers"]]
            ax.plot(depth, values, style, marker="o", label=label)
        ax.set_xticks(depth, last["layers"], rotation=30, ha="right")
        ax.set(title=f"Similarity per layer at round {last['round']} ({estimator})", xlabel="layer (forward order)",
               ylabel="CKA")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out = [save_figure(fig, plots_dir / "representation_similarity_layers.png")]
        lines = {layer: [(r["round"], r["client_client"][layer]) for r in records
                         if r["client_client"].get(layer) is not None] for layer in last["layers"]}
        if any(lines.values()):
            out.append(line_plot({k: v for k, v in lines.items() if v}, f"Mean client-client CKA per layer ({estimator})",
                                 "CKA", plots_dir / "representation_similarity_rounds.png"))
        matrix = last["matrix"]
        values = np.array(matrix["cka"], dtype=float)
        labels = [row if row == "global" else f"client {row}" for row in matrix["rows"]]
        lowest = np.nanmin(values) if np.isfinite(values).any() else 0.0
        out.append(heatmap(values, labels, labels,
                           f"CKA between models at layer {matrix['layer']}, round {last['round']} ({estimator})",
                           plots_dir / "representation_similarity_matrix.png", vmin=min(0.0, lowest), vmax=1.0,
                           xlabel="model"))
        return out
