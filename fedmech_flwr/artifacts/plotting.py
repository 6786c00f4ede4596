"""Plots of a run, drawn from its files only (metrics.jsonl, partitions.json).

``plot_run(run_dir)`` redraws everything; ``fedmech plot RUN_DIR`` calls it. A diagnostic
plug-in draws its own figures through ``Diagnostic.plot``; one that draws none, and the
strategy, get their declared curves (``fedmech_flwr.contracts.outputs``), a flagged value marked.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import traceback
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from fedmech_flwr.contracts.outputs import DEGENERATE_FRACTION, Outputs, declarations, lookup
from fedmech_flwr.foundation.errors import raised_where
from fedmech_flwr.foundation.files import save_figure, write_text_atomic

log = logging.getLogger(__name__)


def line_plot(
    lines: dict[str, list[tuple[int, float]]], title: str, ylabel: str, path: Path, ylim: tuple[float, float] | None = None,
    notes: dict[str, dict[int, str]] | None = None, footnote: str | None = None,
) -> Path:
    """One line per series of (round, value) points, written to ``path``: a diagnostic's
    curves in its ``plot``. A legend when there are few lines; series with the same points
    are drawn once, labelled ``a = b``, so no line hides another.

    Parameters
    ----------
    lines : dict of str to list of (int, float)
        Each series' (round, value) points.
    title, ylabel : str
    path : pathlib.Path
        The image to write.
    ylim : (float, float), optional
    notes : dict, optional
        ``notes[series][round]``, a text written at that point (how many pairs a mean covers).
    footnote : str, optional
        Written under the axes.

    Returns
    -------
    pathlib.Path
        ``path``.

    Examples
    --------
    >>> line_plot({"global_norm": [(1, 3.2), (2, 3.5)]}, "Global norm", "L2", out / "norm.png")  # doctest: +SKIP
    """
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    same: dict[tuple, list[str]] = {}
    for label, points in lines.items():
        same.setdefault(tuple(sorted(points)), []).append(label)
    for labels in same.values():
        xs, ys = zip(*sorted(lines[labels[0]]))
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=" = ".join(labels))
        for x, y in zip(xs, ys):
            if text := (notes or {}).get(labels[0], {}).get(x):
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=6,
                            color=line.get_color())
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if len(same) <= 12:
        ax.legend(fontsize=8, loc="best")
    if footnote:
        fig.supxlabel(footnote, fontsize=7)
    return save_figure(fig, path)


def heatmap(
    matrix: np.ndarray, rounds: list[int], row_labels: list[str], title: str, path: Path,
    vmin: float = 0.0, vmax: float = 1.0, cmap: str = "viridis",
    notes: np.ndarray | None = None, hatch: np.ndarray | None = None, xlabel: str = "round",
    footnote: str | None = None, decimals: int = 2, signed: bool = False,
) -> Path:
    """Rows x rounds (or other columns, named by ``xlabel``), each cell labelled with its
    value, written to ``path``: a diagnostic's per-class or per-layer values in its ``plot``.
    NaN cells (undefined) are grey.

    Parameters
    ----------
    matrix : numpy.ndarray
        Rows x columns.
    rounds : list of int
        The columns' labels.
    row_labels : list of str
    title : str
    path : pathlib.Path
        The image to write.
    vmin, vmax : float
        The colour scale's ends.
    cmap : str
        A matplotlib colormap.
    notes : numpy.ndarray of str, optional
        The matrix's shape: written under a cell's value, or alone in a grey cell.
    hatch : numpy.ndarray of bool, optional
        Cells to hatch (values to read with care, such as IoUs that rest on empty circuits).
    xlabel : str
    footnote : str, optional
        Written under the axes.
    decimals : int
        Places of each cell's value.
    signed : bool
        Show each value's sign (differences).

    Returns
    -------
    pathlib.Path
        ``path``.

    Examples
    --------
    >>> heatmap(accuracy, [1, 2, 3], ["cat", "dog"], "Per-class accuracy", out / "acc.png")  # doctest: +SKIP
    """
    longest = max((len(line) for r in rounds for line in str(r).split("\n")), default=0)  # long column labels widen
    column = max(0.45, 0.075 * longest)
    fig = Figure(figsize=(max(6.0, column * len(rounds) + 3), 0.38 * len(row_labels) + 1.8), layout="constrained")
    ax = fig.subplots()
    colours = matplotlib.colormaps[cmap].with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", cmap=colours, vmin=vmin, vmax=vmax)
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds])
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.set(title=title, xlabel=xlabel)
    for (i, j), v in np.ndenumerate(matrix):
        if hatch is not None and hatch[i, j]:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="0.35", linewidth=0))
        if matrix.size > 400:
            continue
        note = "" if notes is None else notes[i, j]
        if np.isfinite(v):
            red, green, blue, _ = im.cmap(im.norm(v))
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # the cell's luminance
            text, colour = f"{v:{'+' if signed else ''}.{decimals}f}" + (f"\n{note}" if note else ""), \
                "white" if dark else "black"
        else:
            text, colour = note, "black"
        if text:
            ax.text(j, i, text, ha="center", va="center", fontsize=7 if not note else 6, color=colour)
    fig.colorbar(im, ax=ax, shrink=0.8)
    if footnote:
        fig.supxlabel(footnote, fontsize=7)
    return save_figure(fig, path)


Bands = dict[str, list[tuple[int, float, float, float]]]
"""Series of (round, mean, low, high) points by label."""


def _draw_bands(ax, lines: Bands, flagged: dict[str, set[int]], flag_label: str,
                colours: dict[str, Any] | None = None) -> None:
    """``lines`` on ``ax``, each with its band low..high shaded; side-by-side error bars
    when every series has one and the same round (a band of one point has no width);
    points at ``flagged[series]`` rounds ringed in red, labelled once."""
    single = len({point[0] for series in lines.values() for point in series}) == 1
    ringed_once = False
    for i, (label, points) in enumerate(lines.items()):
        rounds, mean, low, high = (np.array(v, dtype=float) for v in zip(*sorted(points)))
        colour = {"color": colours[label]} if colours else {}
        x = rounds + 0.6 * ((i + 0.5) / len(lines) - 0.5) if single else rounds
        if single:
            ax.errorbar(x, mean, yerr=[mean - low, high - mean], fmt="o", markersize=4, capsize=3, label=label, **colour)
        else:
            (line,) = ax.plot(rounds, mean, marker="o", markersize=3, label=label, **colour)
            ax.fill_between(rounds, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ringed = np.isin(rounds, sorted(flagged.get(label, ())))
        if ringed.any():
            ax.plot(x[ringed], mean[ringed], "o", markersize=10, markerfacecolor="none", markeredgecolor="red",
                    markeredgewidth=1.5, label=None if ringed_once else flag_label)
            ringed_once = True
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rounds = {points[0] for series in lines.values() for points in series}
    if len(rounds) == 1:  # one round: give the axis integer ticks around it
        ax.set_xlim(min(rounds) - 1, min(rounds) + 1)
    ax.grid(alpha=0.3)


def band_plot(lines: Bands, title: str, ylabel: str, path: Path, ylim: tuple[float, float] | None = None,
              flagged: dict[str, set[int]] | None = None, flag_label: str = "flagged") -> Path:
    """One line per series of (round, mean, low, high) points with the band low..high
    shaded (``_draw_bands``). The legend sits to the right of the axes, so long labels stay
    readable."""
    fig = Figure(figsize=(9.5, 4.4), layout="constrained")
    ax = fig.subplots()
    _draw_bands(ax, lines, flagged or {}, flag_label)
    ax.set(title=title, xlabel="round", ylabel=ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save_figure(fig, path)


def band_panels(panels: dict[str, Bands], title: str, ylabel: str, path: Path, ylim: tuple[float, float] | None = None,
                flagged: dict[tuple[str, str], set[int]] | None = None, flag_label: str = "flagged") -> Path:
    """Small multiples: one panel per entry of ``panels`` (e.g. a method), each with its
    series (e.g. IID and alpha 0.05) drawn as ``band_plot`` draws them, a series' colour
    the same in every panel, the y axis shared, one legend."""
    labels = list(dict.fromkeys(label for lines in panels.values() for label in lines))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    columns = min(4, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(2.9 * columns + 0.6, 2.3 * rows + 0.9), layout="constrained")
    axes = fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False).ravel()
    for ax, (name, lines) in zip(axes, panels.items()):
        ringed = {label: rounds for (panel, label), rounds in (flagged or {}).items() if panel == name}
        _draw_bands(ax, lines, ringed, flag_label, colours)
        ax.set_title(name, fontsize=9)
    if ylim:
        axes[0].set_ylim(*ylim)
    for i, ax in enumerate(axes):
        if i % columns == 0:
            ax.set_ylabel(ylabel, fontsize=8)
        if i >= len(panels):
            ax.set_visible(False)
        elif i + columns >= len(panels):  # the lowest panel of its column: its round axis is read
            ax.tick_params(labelbottom=True)
            ax.set_xlabel("round")
    handles = {}
    for ax in axes[: len(panels)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    handles = {label: handles[label] for label in sorted(handles, key=lambda label: label == flag_label)}  # rings last
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(6, len(handles)), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


@dataclass
class LevelPanel:
    """One panel of ``level_plot``: series of points at named levels (e.g. skew levels)."""

    title: str
    levels: list[str]
    series: dict[tuple[str, bool], list[tuple[int, float, float | None, str | None]]] = field(default_factory=dict)
    """(name, control) -> points (level index, mean, 95% half-width or None, flag or None);
    a control series (e.g. the dense model) is drawn hollow and dashed."""
    published: list[tuple[int, float, str]] = field(default_factory=list)
    """(level index, value, series name): values to compare with, drawn as stars."""


def level_plot(panels: list[LevelPanel], xlabel: str, ylabel: str, path: Path, published_label: str,
               control_label: str, ylim: tuple[float, float] | None = None) -> Path:
    """Per panel, each series' mean with its interval as error bars against the levels, one
    colour per series name; flagged points ringed red with their flag written beside;
    published values as black-edged stars in the colour of their series."""
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(6.2 * cols + 2.2, 4.2 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    names = list(dict.fromkeys(name for p in panels for name, _ in p.series))
    colours = {name: f"C{i}" for i, name in enumerate(names)}
    handles, marks = {}, {}  # the series, then the marks (flags, published values)
    for ax, panel in zip(axes, panels):
        keys = sorted(panel.series, key=lambda key: (key[1], names.index(key[0])))  # controls after the rest
        for k, (name, control) in enumerate(keys):
            points = sorted(panel.series[(name, control)])
            offset = 0.5 * ((k + 0.5) / len(keys) - 0.5)
            x = np.array([p[0] for p in points], dtype=float) + offset
            mean = np.array([p[1] for p in points])
            half = np.array([np.nan if p[2] is None else p[2] for p in points])
            bars = ax.errorbar(x, mean, yerr=np.nan_to_num(half), fmt="s--" if control else "o-", color=colours[name],
                               markerfacecolor="white" if control else colours[name], markersize=6, capsize=3,
                               linewidth=1.0, alpha=0.9)
            handles.setdefault(f"{name}{' (' + control_label + ')' if control else ''}", bars)
            for xi, m, p in zip(x, mean, points):
                if p[3]:
                    ring = ax.plot(xi, m, "o", markersize=14, markerfacecolor="none", markeredgecolor="red",
                                   markeredgewidth=1.5)[0]
                    marks.setdefault("flagged: not a measurement (see the caption)", ring)
                    ax.annotate(p[3], (xi, m), textcoords="offset points", xytext=(8, -12), fontsize=7, color="red")
        for level, value, name in panel.published:
            star = ax.plot(level + 0.32, value, "*", markersize=13, color=colours.get(name, "black"),
                           markeredgecolor="black")[0]
            marks.setdefault(published_label, star)
        ax.set_xticks(range(len(panel.levels)), panel.levels)
        ax.set_xlim(-0.6, len(panel.levels) - 0.4)
        ax.set(title=panel.title, xlabel=xlabel, ylabel=ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles.update(marks)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8, frameon=False)
    return save_figure(fig, path)


def declared_curves(source: str, outputs: Outputs, records: list[dict[str, Any]], plots: Path) -> list[Path]:
    """One figure per declared curve of ``outputs`` (``plots/<source>_<key>.png``) that
    ``records`` measured, each flagged round marked ``⚑ flag``."""
    out = []
    for key in outputs.curves:
        metric = outputs.metrics[key]
        points, notes = [], {}
        for r in records:
            value = lookup(r, metric.path)
            if isinstance(value, float):
                points.append((r["round"], metric.display(value)))
                if metric.flag and (flag := metric.flag(r)):
                    notes[r["round"]] = f"⚑ {flag}"
        if points:
            out.append(line_plot({metric.label: points}, f"{outputs.title}: {metric.label}", metric.unit,
                                 plots / f"{source}_{key.replace('.', '_')}.png",
                                 notes={metric.label: notes}, footnote="⚑ a flagged value: do not read it as a "
                                                                       "measurement" if notes else None))
    return out


def class_labels(classes: Iterable[int], class_names: Sequence[str] | None) -> list[str]:
    """Row labels of per-class plots: the dataset's class names, else the class numbers."""
    return [class_names[c] if class_names else str(c) for c in classes]


BARS_UP_TO = 200
"""Up to this many clients, one bar per client and class; above, one filled band per class
(the bars would be thinner than a pixel, and 10,000 clients' 40,000 bars took half a
minute to draw; a band is one polygon: 100,000 clients draw in seconds)."""


def plot_label_distribution(
    hist: np.ndarray, path: str | Path, class_names: Sequence[str] | None = None
) -> Path:
    """Save a stacked horizontal bar chart of per-client label counts as a PNG."""
    num_clients, num_classes = hist.shape
    names = list(class_names) if class_names is not None else [str(c) for c in range(num_classes)]
    if num_classes <= 20:  # qualitative palettes keep neighbouring classes distinct
        colours = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"].colors
    else:
        colours = matplotlib.colormaps["turbo"](np.linspace(0, 1, num_classes))
    ncols = 1 if num_classes <= 25 else 2
    legend_rows = -(-num_classes // ncols)
    height = min(12.0, max(1.6 + 0.32 * num_clients, 1.2 + 0.2 * legend_rows))
    fig = Figure(figsize=(9, height), layout="constrained")
    ax = fig.subplots()
    y = np.arange(num_clients)
    left = np.zeros(num_clients)
    for c in range(num_classes):
        if num_clients <= BARS_UP_TO:
            ax.barh(y, hist[:, c], left=left, color=colours[c], label=names[c], height=0.8)
        else:
            edges = np.repeat(np.arange(num_clients + 1) - 0.5, 2)[1:-1]  # one step per client
            ax.fill_betweenx(edges, np.repeat(left, 2), np.repeat(left + hist[:, c], 2), linewidth=0,
                             color=colours[c], label=names[c])
        left += hist[:, c]
    if num_clients <= 40:
        ax.set_yticks(y, [str(i) for i in y])
        for i, total in enumerate(left):
            ax.text(total, i, f" {int(total)}", va="center", fontsize=8)
    ax.set_xlim(0, max(1.0, left.max()) * 1.1)  # room for the totals
    ax.set_ylim(num_clients - 0.5, -0.5)  # client 0 on top
    ax.set(xlabel="training samples", ylabel="client")
    ax.set_title(f"Label distribution over {num_clients} clients")
    ax.legend(title="class", loc="upper left", bbox_to_anchor=(1.01, 1), ncols=ncols, fontsize=8)
    path = save_figure(fig, path)
    log.info("label distribution plot saved to %s", path)
    return path


def plot_run(run_dir: str | Path) -> list[Path]:
    """Redraw every plot of a run folder into ``<run>/plots``; return the files, and list
    which drew which in ``plots/drawn.json`` (``DRAWN_FILE``: ``core``, ``strategy``, each
    diagnostic by name), where the page finds a plug-in's own plots."""
    from fedmech_flwr.contracts.hooks import DIAGNOSTICS
    from fedmech_flwr.artifacts.folder import PARTITIONS_FILE, PLOTS_DIR, read_records

    run_dir = Path(run_dir)
    plots = run_dir / PLOTS_DIR
    records = read_records(run_dir)
    out: list[Path] = []
    part_file = run_dir / PARTITIONS_FILE
    class_names = None
    if part_file.is_file():
        parts = json.loads(part_file.read_text())
        class_names = parts["class_names"]
        if parts["clients"]:  # none when every node was refused
            hist = np.array([c["label_histogram"] for c in parts["clients"]])
            out.append(plot_label_distribution(hist, plots / "label_distribution.png", class_names))

    evals = [r for r in records if r["kind"] == "eval"]
    clients = [r for r in records if r["kind"] == "client"]
    if evals:
        acc = {"global model (test)": [(r["round"], r["accuracy"]) for r in evals]}
        by_round = defaultdict(list)
        for r in clients:  # a user's own ClientApp (fedmech_flwr.app.flower) may report neither
            if "train_accuracy" in r:
                by_round[r["round"]].append(r["train_accuracy"])
        if by_round:
            acc["clients, mean train accuracy"] = [(k, float(np.mean(v))) for k, v in by_round.items()]
        one_class = {r["round"]: f"⚑ one class {r['max_predicted_fraction']:.0%}" for r in evals
                     if r.get("max_predicted_fraction", 0.0) > DEGENERATE_FRACTION}
        out.append(line_plot(acc, "Accuracy over rounds", "accuracy", plots / "accuracy.png", (0.0, 1.0),
                             notes={"global model (test)": one_class},
                             footnote=f"⚑ one class: the global model predicts one class for more than "
                                      f"{DEGENERATE_FRACTION:.0%} of the test images" if one_class else None))
        out.append(line_plot({"global model (test)": [(r["round"], r["loss"]) for r in evals]},
                             "Test loss over rounds", "cross-entropy", plots / "loss.png"))
        rounds = [r["round"] for r in evals]
        per_class = np.array([[np.nan if v is None else v for v in r["per_class_accuracy"]] for r in evals]).T
        out.append(heatmap(per_class, rounds, class_labels(range(per_class.shape[0]), class_names),
                           "Per-class test accuracy of the global model",
                           plots / "per_class_accuracy.png"))
        sparsity = {"global model": [(r["round"], r["sparsity"]) for r in evals]}
        mean_client = defaultdict(list)
        for r in clients:
            if "sparsity" in r:
                mean_client[r["round"]].append(r["sparsity"])
        if mean_client:
            sparsity["clients (mean)"] = [(k, float(np.mean(v))) for k, v in mean_client.items()]
        out.append(line_plot(sparsity, "Actual sparsity of prunable layers", "fraction of zero weights",
                             plots / "sparsity.png", (0.0, 1.0)))

    declared = declarations()
    by: dict[str, list[Path]] = {"core": out}
    diag_records = defaultdict(list)
    for r in records:
        if r["kind"] == "diagnostic":
            diag_records[r["name"]].append(r)
    skipped = []
    for name, recs in diag_records.items():
        drawn, problem = [], None
        if name in DIAGNOSTICS:
            drawn, problem = _plugin_plots(DIAGNOSTICS.get(name).factory, recs, plots, class_names)
        else:  # a user's diagnostic whose module this process did not import (a reader never does)
            log.warning("diagnostic %r is not imported here: its declared curves are drawn, its own plots only by "
                        "`fedmech plot RUN_DIR --plugin MODULE`", name)
        if problem:
            skipped.append({"diagnostic": name, **problem})
            log.warning("the plots of diagnostic %r were not drawn: %s in %s", name, problem["reason"], problem["where"])
        if not drawn and name in declared:
            drawn = declared_curves(name, declared[name], recs, plots)
        by[name] = list(drawn)
    if "strategy" in declared:
        by["strategy"] = declared_curves("strategy", declared["strategy"],
                                         [r for r in records if r["kind"] == "strategy"], plots)
    (plots / SKIPPED_FILE).unlink(missing_ok=True)
    if skipped:
        write_text_atomic(plots / SKIPPED_FILE, json.dumps(skipped, indent=1))
    write_text_atomic(plots / DRAWN_FILE, json.dumps(
        {source: [Path(p).name for p in paths] for source, paths in by.items() if paths}, indent=1))
    return [path for paths in by.values() for path in paths]


DRAWN_FILE = "drawn.json"
"""In ``plots/``: the file names of the plots each source drew, keyed ``core``, ``strategy``
or a diagnostic's name."""
SKIPPED_FILE = "skipped.json"
"""In ``plots/``: the plug-in plots that were not drawn (which, where it failed, why)."""


def _plugin_plots(plugin: Any, records: list[dict[str, Any]], plots: Path,
                  class_names: list[str] | None) -> tuple[list[Path], dict[str, str] | None]:
    """A diagnostic plug-in's own figures, those a reader can open: a ``plot`` that raises,
    or writes a file that is not a readable image, costs its figures (returned as the
    problem: ``where`` the plug-in's file:line, and the ``reason``), never the run."""
    import matplotlib.image

    try:
        drawn = list(plugin.plot(records, plots, class_names))
    except Exception as err:
        where = raised_where((f.filename, f.lineno) for f in traceback.extract_tb(err.__traceback__))
        return [], {"where": where or _defined_at(plugin.plot), "reason": f"{type(err).__name__}: {_brief(err)}"}
    for path in drawn:
        try:
            matplotlib.image.imread(path)
        except Exception as err:
            for other in drawn:
                Path(other).unlink(missing_ok=True)
            return [], {"where": _defined_at(plugin.plot),
                        "reason": f"it wrote {path}, which is not a readable image ({_brief(err)})"}
    return drawn, None


def _brief(err: Exception) -> str:
    return " ".join(str(err).split())[:200]


def _defined_at(function: Any) -> str:
    """``file:line`` where ``function`` is defined."""
    try:
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (OSError, TypeError):
        return repr(function)


def skipped_plots(run_dir: str | Path) -> list[dict[str, str]]:
    """What ``plot_run`` could not draw in ``run_dir`` (its ``plots/skipped.json``)."""
    from fedmech_flwr.artifacts.folder import PLOTS_DIR

    path = Path(run_dir) / PLOTS_DIR / SKIPPED_FILE
    return json.loads(path.read_text()) if path.is_file() else []
