"""Plots of a run, drawn from its files only (metrics.jsonl, partitions.json).

``plot_run(run_dir)`` redraws everything; ``fedmech plot RUN_DIR`` calls it. Diagnostic
plug-ins draw their own figures through ``Diagnostic.plot``.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedmech_flwr.files import save_figure

log = logging.getLogger(__name__)


def line_plot(
    lines: dict[str, list[tuple[int, float]]], title: str, ylabel: str, path: Path, ylim: tuple[float, float] | None = None
) -> Path:
    """One line per series of (round, value) points; a legend when there are few lines."""
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if len(lines) <= 12:
        ax.legend(fontsize=8, loc="best")
    return save_figure(fig, path)


def heatmap(
    matrix: np.ndarray, rounds: list[int], row_labels: list[str], title: str, path: Path,
    vmin: float = 0.0, vmax: float = 1.0, cmap: str = "viridis",
) -> Path:
    fig = Figure(figsize=(max(6.0, 0.45 * len(rounds) + 3), 0.38 * len(row_labels) + 1.8), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds])
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.set(title=title, xlabel="round")
    if matrix.size <= 400:
        for (i, j), v in np.ndenumerate(matrix):
            if np.isfinite(v):
                red, green, blue, _ = im.cmap(im.norm(v))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # the cell's luminance
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, shrink=0.8)
    return save_figure(fig, path)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Redraw every plot of a run folder into ``<run>/plots``; return the files."""
    from fedmech_flwr.hooks import DIAGNOSTICS
    from fedmech_flwr.partition import plot_label_distribution
    from fedmech_flwr.run_folder import PARTITIONS_FILE, PLOTS_DIR, read_records

    run_dir = Path(run_dir)
    plots = run_dir / PLOTS_DIR
    records = read_records(run_dir)
    out: list[Path] = []
    part_file = run_dir / PARTITIONS_FILE
    class_names = None
    if part_file.is_file():
        parts = json.loads(part_file.read_text())
        class_names = parts["class_names"]
        hist = np.array([c["label_histogram"] for c in parts["clients"]])
        out.append(plot_label_distribution(hist, plots / "label_distribution.png", class_names))

    evals = [r for r in records if r["kind"] == "eval"]
    clients = [r for r in records if r["kind"] == "client"]
    if evals:
        acc = {"global model (test)": [(r["round"], r["accuracy"]) for r in evals]}
        by_round = defaultdict(list)
        for r in clients:
            by_round[r["round"]].append(r["train-accuracy"])
        if by_round:
            acc["clients, mean train accuracy"] = [(k, float(np.mean(v))) for k, v in by_round.items()]
        out.append(line_plot(acc, "Accuracy over rounds", "accuracy", plots / "accuracy.png", (0.0, 1.0)))
        out.append(line_plot({"global model (test)": [(r["round"], r["loss"]) for r in evals]},
                             "Test loss over rounds", "cross-entropy", plots / "loss.png"))
        rounds = [r["round"] for r in evals]
        per_class = np.array([[np.nan if v is None else v for v in r["per_class_accuracy"]] for r in evals]).T
        names = class_names or [str(c) for c in range(per_class.shape[0])]
        out.append(heatmap(per_class, rounds, names, "Per-class test accuracy of the global model",
                            plots / "per_class_accuracy.png"))
        sparsity = {"global model": [(r["round"], r["sparsity"]) for r in evals]}
        if by_round:
            mean_client = defaultdict(list)
            for r in clients:
                mean_client[r["round"]].append(r["sparsity"])
            sparsity["clients (mean)"] = [(k, float(np.mean(v))) for k, v in mean_client.items()]
        out.append(line_plot(sparsity, "Actual sparsity of prunable layers", "fraction of zero weights",
                             plots / "sparsity.png", (0.0, 1.0)))

    diag_records = defaultdict(list)
    for r in records:
        if r["kind"] == "diagnostic":
            diag_records[r["name"]].append(r)
    for name, recs in diag_records.items():
        if name in DIAGNOSTICS:
            out.extend(DIAGNOSTICS.get(name).factory.plot(recs, plots))
        else:
            log.warning("no plug-in named %s is registered; its plots are skipped", name)
    return out
