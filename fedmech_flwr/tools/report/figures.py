"""The report's figures, drawn from the completed runs of each group: the headline (the
``by_skew`` accuracies against the label-skew level), per-round curves with seed bands and
per-class heatmaps."""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from fedmech_flwr.artifacts.plotting import LevelPanel, band_panels, band_plot, heatmap, level_plot
from fedmech_flwr.artifacts.reader import FolderRun
from fedmech_flwr.contracts.outputs import DEGENERATE_FRACTION, Metric, declarations, declared, latest, lookup, per_class_values
from fedmech_flwr.spec.config import flatten_plain
from fedmech_flwr.tools.published import PaperValues
from fedmech_flwr.tools.report.comparisons import Comparison
from fedmech_flwr.tools.report.statistics import Group, Stat, axis_name, is_dense_control, skew_level
from fedmech_flwr.tools.report.stats import mean_ci


PER_FIGURE = 10
"""Groups per figure; more are split over several."""


MIN_CURVE_ROUNDS = 3
"""A declared curve of a metric measured at fewer rounds is not drawn (the tables show it)."""


DEGENERATE_NOTE = (f"⚑ one class k/n: in k of the n seeds the model predicts one class for more than "
                   f"{DEGENERATE_FRACTION:.0%} of the test images; its column averages such predictors")


def _chunks(items: list) -> list[list]:
    """``items`` in as few figures as hold ``PER_FIGURE`` each, evenly filled (12 -> 6 + 6,
    not 10 + 2), so that in a grid the figures follow its axes where they can."""
    parts = max(1, math.ceil(len(items) / PER_FIGURE))
    size = math.ceil(len(items) / parts) if items else 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def _series(metric: Metric, runs: list[FolderRun]) -> tuple[list[tuple[int, float, float, float]], int, dict[int, str]]:
    """Per round: mean and band (95% CI, or min..max with fewer than two runs); most runs;
    the rounds where a run's value is flagged, with the flag."""
    by_round: dict[int, list[float]] = defaultdict(list)
    flagged = {}
    for run in runs:
        for record in run.records_of(metric.record):
            if isinstance(value := lookup(record, metric.path), float):
                by_round[record["round"]].append(metric.display(value))
                if metric.flag and (flag := metric.flag(record)):
                    flagged[record["round"]] = flag
    points = []
    for server_round, values in sorted(by_round.items()):
        mean, half, _ = mean_ci(values)
        low, high = (min(values), max(values)) if half is None else (mean - half, mean + half)
        points.append((server_round, mean, low, high))
    return points, max((len(v) for v in by_round.values()), default=0), flagged


def _wrap(label: str, width: int) -> str:
    """A plot label broken into lines, so long group names fit legends and axes."""
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False)) or label


def _file_name(stem: str, part: int, parts: int) -> str:
    return f"{stem}.png" if parts == 1 else f"{stem}_{part}.png"


def plot_curves(groups: list[Group], plots: Path) -> list[tuple[Path, str]]:
    """Per-round curves of the completed runs with seed bands and flagged rounds ringed;
    none for a metric measured at fewer than ``MIN_CURVE_ROUNDS``. One line per group, or,
    where groups differ in their label skew and in more, one panel per rest (a method) with
    a line per skew level, so each group sits beside its own control."""
    out = []
    metrics = declared()
    panels: dict[str, list[Group]] = defaultdict(list)
    for group in groups:
        panels[_without_skew(group.config)].append(group)
    by_panel = len(panels) > 1 and any(len(members) > 1 for members in panels.values())
    for key in (f"{record}.{k}" for record, outputs in declarations().items() for k in outputs.curves):
        metric, stem = metrics[key], key.replace(".", "_")
        title, ylabel = f"{metric.label} ({metric.unit}) over rounds, mean over seeds", f"{metric.label} ({metric.unit})"
        lines, flags = {}, {}
        for group in groups:
            points, n, flagged = _series(metric, group.completed)
            if points:
                label = (_panel_title(group), f"{skew_level(group.config)[1]}{_pruning(group)}") if by_panel \
                    else _wrap(f"{group.label} (n={n}, {'95% CI' if n >= 2 else 'min–max'})", 48)
                lines[label], flags[label] = points, flagged
        if max((len(points) for points in lines.values()), default=0) < MIN_CURVE_ROUNDS:
            continue
        if by_panel:
            grid: dict[str, dict[str, Any]] = defaultdict(dict)
            for (panel, line), points in lines.items():
                grid[panel][line] = points
            ringed = {label: set(flagged) for label, flagged in flags.items() if flagged}
            path = band_panels(dict(grid), title, ylabel, plots / f"{stem}.png", metric.limits, flagged=ringed,
                               flag_label=_flag_label(flags.values()))
            out.append((path, title + "; bands: 95% CI (min–max with one seed), n in the tables"))
            continue
        chunks = _chunks(list(lines.items()))
        for part, chunk in enumerate(chunks, 1):
            part_title = title + (f" ({part} of {len(chunks)})" if len(chunks) > 1 else "")
            flagged = {label: set(flags[label]) for label, _ in chunk if flags[label]}
            path = band_plot(dict(chunk), part_title, ylabel, plots / _file_name(stem, part, len(chunks)),
                             metric.limits, flagged=flagged, flag_label=_flag_label(flags[label] for label, _ in chunk))
            out.append((path, part_title))
    return out


def _flag_label(flags) -> str:
    """The legend entry of the ringed points: the flags they carry (``one class (ringed)``)."""
    return ", ".join(sorted({name for flagged in flags for name in flagged.values()})) + " (ringed)"


def _panel_title(group: Group) -> str:
    """A group's axes but its label skew and pruning: what its panel compares."""
    rest = [v for k, v in group.axes.items() if "data.partition" not in k and "pruning.mode" not in k]
    return _wrap(", ".join(rest) or group.label, 40)


def _pruning(group: Group) -> str:
    """``, dense`` or ``, magnitude`` where pruning is an axis of the groups, else empty."""
    mode = next((v for k, v in group.axes.items() if "pruning.mode" in k), None)
    return f", {mode}" if mode else ""


def _without_skew(config: dict[str, Any]) -> str:
    flat = flatten_plain(config)
    return json.dumps({k: v for k, v in flat.items() if not k.startswith("data.partition.") and k != "pruning.mode"},
                      sort_keys=True, default=str)


def _short_flags(stat: Stat) -> str | None:
    return ", ".join(f"{flag} {count}/{stat.measured}" for flag, count in stat.flags.items()) or None


def plot_headline(groups: list[Group], comparisons: list[Comparison], plots: Path,
                  paper: PaperValues | None) -> list[tuple[Path, str]]:
    """The paper's claim as one figure: per dataset x model (every config key but the
    partition and the pruning mode), the declared ``by_skew`` accuracies against the skew level, the
    dense control hollow (dense runs are the control only where pruned runs stand beside
    them), flagged values ringed, published values as stars."""
    metrics = declared()
    keys = [f"{record}.{k}" for record, outputs in declarations().items() for k in outputs.by_skew]
    measured = [g for g in groups if any(k in g.stats for k in keys)]
    if not measured:
        return []
    panels: dict[str, list[Group]] = defaultdict(list)
    for g in measured:
        panels[_without_skew(g.config)].append(g)
    drawn, same = [], set()
    for members in panels.values():
        levels = sorted({skew_level(g.config) for g in members})
        index = {label: i for i, (_, label) in enumerate(levels)}
        flat = flatten_plain(members[0].config)
        title = ", ".join(f"{axis_name(k)} {v}" for k, v in members[0].axes.items()
                          if "data.partition" not in k and "pruning.mode" not in k) \
            or f"{flat.get('data.dataset.name')}, {flat.get('model.name')}"
        panel = LevelPanel(title, [label for _, label in levels])
        with_control = len({is_dense_control(g.config) for g in members}) == 2  # dense runs beside pruned ones
        for g in members:
            level = index[skew_level(g.config)[1]]
            for key in keys:
                if (stat := g.stats.get(key)) and stat.mean is not None:
                    series = (metrics[key].label, with_control and is_dense_control(g.config))
                    panel.series.setdefault(series, []).append((level, stat.mean, stat.half_width, _short_flags(stat)))
        for c in comparisons:
            if c.group in members and c.paper.metric in keys and c.paper.relation in ("=", "≈"):
                point = (index[skew_level(c.group.config)[1]], c.paper.value, metrics[c.paper.metric].label)
                panel.published += [point] if point not in panel.published else []
                same.add(c.same_protocol)
        drawn.append(panel)
    protocol = "at the same protocol" if same == {True} else "at another protocol: read the direction, not the level"
    label = f"published ({paper.paper}), {protocol}" if paper else "published"
    path = level_plot(drawn, "label skew", "test accuracy (%)", plots / "headline.png", _wrap(label, 34), "dense control",
                      ylim=(0.0, 100.0))
    seeds = {run.seed for group in groups for run in group.completed}
    spread = ("one seed, so no interval" if len(seeds) == 1 else
              "mean and 95% interval over seeds (n in the tables below)")
    drawn_keys = [k for k in keys if any(k in g.stats for g in measured)]
    caption = f"{', '.join(metrics[k].label for k in drawn_keys)} accuracy against label skew: {spread}"
    if any(control for p in drawn for _, control in p.series):
        caption += "; hollow squares and dashed lines: the dense control"
    if any(point[3] for p in drawn for points in p.series.values() for point in points):
        caption += ("; red rings: values flagged by their validity rule (a one-class model, which predicts one "
                    f"class for more than {DEGENERATE_FRACTION:.0%} of the test images: its accuracy is chance, not a "
                    "measurement; an under-powered probe, which still gained more than a point from its last doubling "
                    "of data: its accuracy is a lower bound)")
    if paper and any(p.published for p in drawn):
        caption += f"; stars: the published values, in their series' colour, {protocol}"
    return [(path, caption)]


def per_class_metrics() -> dict[str, Metric]:
    """The metrics the report draws per class: the global model's accuracy, and each
    declared headline metric with per-class values."""
    metrics = declared()
    chosen = ["eval.accuracy"] + [f"{record}.{key}" for record, outputs in declarations().items()
                                  for key in outputs.headline if record != "eval"]
    return {key: metrics[key] for key in chosen if metrics[key].per_class}


def plot_per_class(groups: list[Group], plots: Path) -> list[tuple[Path, str]]:
    """Per declared per-class metric (``per_class_metrics``): its last-round values per
    class, mean over seeds, one column per group; groups whose datasets name different
    classes go to different figures, a flagged group is labelled with its flag."""
    out = []
    for key, metric in per_class_metrics().items():
        columns: dict[tuple[str, ...], list[tuple[str, list[float]]]] = defaultdict(list)
        for group in groups:
            rows = []
            for run in group.completed:
                if found := latest(metric, run.records):
                    values = per_class_values(metric, found[0])
                    rows += [values] if values is not None else []
            if not rows:
                continue
            table = metric.display(np.array(rows, dtype=float))
            names = group.completed[0].class_names or [str(c) for c in range(table.shape[1])]
            with np.errstate(all="ignore"):
                mean = [float(np.nanmean(col)) if np.isfinite(col).any() else np.nan for col in table.T]
            flags = (stat := group.stats.get(key)) and _short_flags(stat)
            columns[tuple(names)].append((group.label + (f" ⚑ {flags}" if flags else ""), mean))
        is_recall = key == "eval.accuracy"
        title = ("Last-round per-class recall of the global model" if is_recall
                 else f"Last-round {metric.label} per class") + f" ({metric.unit}), mean over seeds"
        scale = {"%": (0.0, 100.0, "viridis"), "pp": (-100.0, 100.0, "coolwarm")}.get(metric.unit)
        for index, (names, cols) in enumerate(columns.items(), 1):
            chunks = _chunks(cols)
            for part, chunk in enumerate(chunks, 1):
                stem = "per_class_recall" if is_recall else f"per_class_{key.replace('.', '_')}"
                stem += "" if len(columns) == 1 else f"_{index}"
                matrix = np.array([values for _, values in chunk]).T
                vmin, vmax, cmap = scale or (float(np.nanmin(matrix)), float(np.nanmax(matrix)), "viridis")
                flagged = any("⚑" in label for label, _ in chunk)
                path = heatmap(matrix, [_wrap(label, 24) for label, _ in chunk], list(names), title,
                               plots / _file_name(stem, part, len(chunks)), vmin=vmin, vmax=vmax, cmap=cmap,
                               notes=np.where(np.isfinite(matrix), "", "n/a"), xlabel="group",
                               footnote=DEGENERATE_NOTE if flagged else None, decimals=metric.decimals,
                               signed=metric.unit == "pp")
                out.append((path, title + (f" ({part} of {len(chunks)})" if len(chunks) > 1 else "")))
    return out
