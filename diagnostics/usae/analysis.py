"""One USAE analysis end to end: aligned tokens of M models at a layer, a trained USAE,
and JSON-able metrics (R^2 matrix, sparsity, shared / unique concepts, stitching), plus
their plots. Used by ``fedmech usae`` and by the per-round ``usae`` diagnostic.

Metrics are computed a chunk of images at a time, so only the training tokens may be
held in memory, and only while they fit ``memory_limit_bytes`` (else they are streamed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api._builtin import save_figure
from fedmech_flwr.api.model import FedMechModel

from .activations import InMemorySource, StreamingSource, check_layer, collect_tokens
from .metrics import (
    CALIBRATED_ALPHA,
    ConceptOverlap,
    MetricsAccumulator,
    Stitch,
    calibrated_overlap,
    concept_mask,
    finish_from_layer,
    shared_unique,
    stitch_all,
)
from .model import USAE, Schedule, USAEConfig
from .train import train_usae


@dataclass
class CpuUSAEConfig(USAEConfig):
    """``USAEConfig`` with CPU-sized defaults (the paper's: expansion 8, k 48, 100 epochs)
    and the symmetric schedule, so that identical models share every concept."""

    expansion: int = field(default=4, metadata={"ge": 1})
    k: int = field(default=16, metadata={"ge": 1})
    epochs: int = field(default=10, metadata={"ge": 1})
    schedule: Schedule = "symmetric"


PRESETS: dict[str, type[USAEConfig]] = {"cpu": CpuUSAEConfig, "paper": USAEConfig}
"""``fedmech usae --preset``: the CPU defaults, or the paper's settings."""

CONCEPT_SETS = ("all", "shared", "unique")
METRICS_CHUNK_IMAGES = 256
FIT_R2 = 0.5
"""Self-reconstruction R^2 (each model's tokens from its own codes) that every model must
reach for ``metrics["fit"]``: below it the dictionary does not describe the model, and
its concepts, overlap and stitching say little."""

log = logging.getLogger(__name__)


def _finite(value: float) -> float | None:
    """JSON-able float: NaN / inf become None."""
    return float(value) if math.isfinite(value) else None


def check_inputs(models: Sequence[FedMechModel], layer: str, x: Tensor, cfg: USAEConfig) -> list[int]:
    """ConfigErrors for a missing layer, no images or k above the dictionary size; the
    models' widths at ``layer``."""
    if len(models) < 2:
        raise ConfigError(f"a USAE compares at least 2 models, got {len(models)}", "usae sources")
    check_layer(models, layer)
    if len(x) == 0:
        raise ConfigError("no images to collect activations from (the chosen split is empty)", "usae data")
    widths = [model.gated_layers()[layer] for model in models]
    size = cfg.dictionary_size(widths)
    if cfg.k > size:
        raise ConfigError(
            f"k={cfg.k} exceeds the dictionary size {size} (expansion {cfg.expansion} x width "
            f"{max(widths)}{'' if cfg.dict_size is None else ', dict_size'}); lower k or raise expansion / dict_size",
            "usae.k",
        )
    return widths


def _tokens_per_image(models: Sequence[FedMechModel], layer: str, x: Tensor) -> int:
    return len(collect_tokens(models[:1], layer, x[:1])[0])


def analyse(
    models: list[FedMechModel],
    names: list[str],
    layer: str,
    x: Tensor,
    y: Tensor,
    cfg: USAEConfig,
    device: str | torch.device = "cpu",
    threshold: float = 0.01,
    memory_limit_bytes: int = 1 << 30,
) -> tuple[USAE, dict[str, Any]]:
    """Train a USAE on ``models``' tokens at ``layer`` on images ``x`` and measure it.

    Returns the USAE and JSON-able metrics; ``metrics["activity"]`` is the [M, n] firing
    frequency matrix (lists), the only large entry. Concepts are "active" in a model when
    their firing frequency there is > 0 (``overlap["fires_once"]``: the project's reading
    of the paper's "activate non-trivially", which its texts do not define) or >
    ``threshold`` (``overlap["thresholded"]``, also the rule of the stitching sets);
    ``overlap["calibrated"]`` is the fires-once rule with unique concepts that fire too
    rarely to be told from chance set apart (``calibrated_overlap``). ``metrics["fit"]``
    is false, with a warning, when a model's self-reconstruction R^2 is below ``FIT_R2``.
    """
    if len(names) != len(models):
        raise ValueError(f"{len(models)} models but {len(names)} names")
    widths = check_inputs(models, layer, x, cfg)
    per_image = _tokens_per_image(models, layer, x)
    token_bytes = len(x) * per_image * sum(widths) * 4
    if token_bytes <= memory_limit_bytes:
        source: Any = InMemorySource(collect_tokens(models, layer, x))
        source_kind = "memory"
    else:
        source = StreamingSource(models, layer, x)
        source_kind = "streaming"
    usae, history = train_usae(source, cfg, device)
    del source

    m = len(models)
    chunks = [(x[s : s + METRICS_CHUNK_IMAGES], y[s : s + METRICS_CHUNK_IMAGES])
              for s in range(0, len(x), METRICS_CHUNK_IMAGES)]
    # pass 1: R^2 (residual and total sums of squares over all tokens) and firing counts
    acc = MetricsAccumulator(widths, usae.dict_size)
    for xc, _ in chunks:
        acc.add(usae, collect_tokens(models, layer, xc))
    r2, activity = acc.r2(), acc.activity()

    # pass 2: stitching i -> j for concept sets all / shared / unique-to-i
    masks = {i: {c: concept_mask(c, i, activity, threshold) for c in CONCEPT_SETS} for i in range(m)}
    stitches = {(i, j, c): Stitch(0, 0, 0) for j in range(m) for i in range(m) for c in CONCEPT_SETS}
    for xc, yc in chunks:
        finishes = {j: finish_from_layer(model, layer, xc) for j, model in enumerate(models)}
        chunk = stitch_all(usae, collect_tokens(models, layer, xc), finishes, yc.cpu(), masks)
        for key, s in chunk.items():
            stitches[key] += s
    o = shared_unique(activity, threshold)
    kept = {"all": [usae.dict_size] * m, "shared": [o.shared] * m, "unique": o.unique}
    stitching = [
        {"source": names[i], "target": names[j], "concepts": concepts, "concepts_kept": kept[concepts][i],
         "accuracy": s.accuracy, "own_accuracy": s.own_accuracy, "percent_of_own": _finite(s.percent_of_own)}
        for (i, j, concepts), s in stitches.items()
    ]

    def described(o: ConceptOverlap) -> dict[str, Any]:
        return {"shared": o.shared, "unique": dict(zip(names, o.unique)), "dead": o.dead, "alive": o.alive,
                "overlap": _finite(o.overlap)}

    def overlap_at(t: float) -> dict[str, Any]:
        return {"threshold": t, **described(shared_unique(activity, t)),
                "active_per_model": dict(zip(names, (activity > t).sum(1).astype(int).tolist()))}

    calibrated, min_count = calibrated_overlap(acc.counts())
    off = ~np.eye(m, dtype=bool)
    fit = bool((np.diag(r2) >= FIT_R2).all())  # a NaN R^2 is not fit
    if not fit:
        log.warning(
            "USAE at %s is not fit: self-reconstruction R^2 %s, below %g, after %d steps over %d tokens; its "
            "concepts, overlap and stitching say little: train longer (raise min_steps or epochs)",
            layer, ", ".join(f"{n} {v:.3f}" for n, v in zip(names, np.diag(r2))), FIT_R2,
            history["steps"][-1], acc.count)
    metrics = {
        "models": list(names),
        "layer": layer,
        "widths": widths,
        "dict_size": usae.dict_size,
        "k": usae.k,
        "num_images": len(x),
        "num_tokens": acc.count,
        "token_source": source_kind,
        "r2": [[_finite(v) for v in row] for row in r2],
        "r2_self_mean": _finite(float(np.mean(np.diag(r2)))),
        "r2_cross_mean": _finite(float(np.mean(r2[off]))),
        "fit": fit,
        "l0": dict(zip(names, activity.sum(1).tolist())),
        "dead_fraction": float((activity.sum(0) == 0).mean()),
        "overlap": {"fires_once": overlap_at(0.0), "thresholded": overlap_at(threshold),
                    "calibrated": {"alpha": CALIBRATED_ALPHA, "min_count": min_count, **described(calibrated),
                                   "too_rare": calibrated.too_rare}},
        "stitching": stitching,
        "train_history": {key: values[-1] for key, values in history.items() if values},
        "activity": activity.tolist(),
    }
    return usae, metrics


def _overlap_value(overlap: dict[str, Any], rule: str) -> str:
    v = overlap[rule]["overlap"]
    return "n/a" if v is None else f"{v:.3f}"


def overlap_summary(overlap: dict[str, Any]) -> str:
    """The shared / alive fraction under each rule, rounded, for console lines."""
    return (f"shared/alive {_overlap_value(overlap, 'fires_once')} "
            "(fires once, the project's reading of the paper), "
            f"{_overlap_value(overlap, 'thresholded')} (> {overlap['thresholded']['threshold']:g} of tokens), "
            f"{_overlap_value(overlap, 'calibrated')} (calibrated: unique needs >= "
            f"{overlap['calibrated']['min_count']} firings)")


def _overlap_lines(metrics: dict[str, Any]) -> list[str]:
    """A plot's footer: the rules once, then the comparison's and each control's fractions."""
    overlap = metrics["overlap"]
    rows = [("comparison", overlap)]
    if "null_control" in metrics:
        rows.append((f"null control ({metrics['null_control']['models'][0]} vs itself)",
                     metrics["null_control"]["overlap"]))
    if "seed_control" in metrics:
        rows.append((f"seed control (USAE seed {metrics['seed_control']['seed']})", metrics["seed_control"]["overlap"]))
    header = (f"shared/alive: fires once (the project's reading of the paper) / "
              f"> {overlap['thresholded']['threshold']:g} of tokens / "
              f"calibrated (unique needs >= {overlap['calibrated']['min_count']} firings)")
    rules = ("fires_once", "thresholded", "calibrated")
    return [header] + [f"{label}: " + " / ".join(_overlap_value(o, rule) for rule in rules) for label, o in rows]


# --- plots ------------------------------------------------------------------------------

def _labels(names: list[str], width: int = 16) -> tuple[list[str], str | None]:
    """Names short enough for tick labels, else M0, M1, ... and a key to print."""
    if max(len(n) for n in names) <= width:
        return list(names), None
    return [f"M{i}" for i in range(len(names))], "   ".join(f"M{i} = {n}" for i, n in enumerate(names))


def plot_usae(metrics: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """R^2 matrix, concept firing-frequency histogram and stitching bars, as PNGs."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    full_names = metrics["models"]
    names, key = _labels(full_names)
    m = len(names)
    out = []

    r2 = np.array([[np.nan if v is None else v for v in row] for row in metrics["r2"]])
    side = max(4.5, 1.1 * m + 2.5)
    fig = Figure(figsize=(side + 1, side), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(r2), cmap="viridis", vmin=min(0.0, float(np.nanmin(r2))), vmax=1.0)
    ax.set_xticks(range(m), names, rotation=30, ha="right")
    ax.set_yticks(range(m), names)
    ax.set(xlabel="reconstructed model j", ylabel="encoding model i",
           title=f"USAE R$^2$ at {metrics['layer']}\nrow i's codes -> column j's activations")
    for (i, j), v in np.ndenumerate(r2):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=10, color="white" if v < 0.6 else "black")
    fig.colorbar(im, ax=ax, shrink=0.8, label="R$^2$")
    if key:
        fig.supxlabel(key, fontsize=7)
    out.append(save_figure(fig, out_dir / "usae_r2.png"))

    activity = np.asarray(metrics["activity"])
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    floor = 1.0 / max(1, metrics["num_tokens"])
    bins = np.logspace(np.log10(floor), 0, 30)
    for name, row in zip(names, activity):
        ax.hist(np.clip(row, floor, 1.0), bins=bins, histtype="step", linewidth=1.5,
                label=f"{name} ({int((row > 0).sum())} fire, {int((row == 0).sum())} never)")
    ax.set_xscale("log")
    thresholded = metrics["overlap"]["thresholded"]["threshold"]
    if thresholded > 0:
        ax.axvline(thresholded, color="grey", linestyle="--", linewidth=1, label=f"threshold {thresholded:g}")
    min_count = metrics["overlap"]["calibrated"]["min_count"]
    ax.axvline(min_count / max(1, metrics["num_tokens"]), color="black", linestyle=":", linewidth=1,
               label=f"calibrated: unique needs >= {min_count} firings")
    ax.set(xlabel=f"firing frequency (fraction of tokens; never-firing concepts drawn at {floor:.0e})",
           ylabel="concepts", title=f"Concept activity per model ({metrics['dict_size']} concepts, k={metrics['k']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    lines = _overlap_lines(metrics)
    fig.supxlabel("\n".join(lines + ([key] if key else [])), fontsize=7)
    out.append(save_figure(fig, out_dir / "usae_activity.png"))

    label_of = dict(zip(full_names, names))
    rows = [{**r, "source": label_of[r["source"]], "target": label_of[r["target"]]} for r in metrics["stitching"]]
    pairs = list(dict.fromkeys((r["source"], r["target"]) for r in rows))
    fig = Figure(figsize=(max(7.5, 0.9 * len(pairs) + 2), 4.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(CONCEPT_SETS)
    for c, concepts in enumerate(CONCEPT_SETS):
        by_pair = {(r["source"], r["target"]): r for r in rows if r["concepts"] == concepts}
        values = [by_pair[p]["percent_of_own"] if by_pair[p]["percent_of_own"] is not None else np.nan for p in pairs]
        positions = np.arange(len(pairs)) + (c - 1) * width
        label = {"all": "all concepts", "shared": "shared concepts", "unique": "unique to source"}[concepts]
        ax.bar(positions, values, width, label=label)
    ax.axhline(100, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(pairs)), [f"{a}\n-> {b}" for a, b in pairs], fontsize=8,
                  rotation=0 if len(pairs) <= 9 else 45)
    ax.set(ylabel="% of target model's own accuracy",
           title=f"Stitching: source's codes decoded into target at {metrics['layer']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(0, max(110.0, float(np.nanmax([r["percent_of_own"] or 0 for r in rows])) + 5))
    if key:
        fig.supxlabel(key, fontsize=7)
    out.append(save_figure(fig, out_dir / "usae_stitching.png"))
    return out
