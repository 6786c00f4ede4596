"""``fedmech report SWEEP_DIR | RUN_DIR ... --out DIR``: one page over many runs.

Runs whose configs differ only by their seed form a group. For each group the report gives
the mean ± 95% confidence interval (Student t over seeds, n shown) of every metric in
``METRICS`` at each run's final round, per-round curves with seed bands, per-class recall
heatmaps, a strategy leaderboard (when strategies or clients vary), published values next
to the groups they describe, and where every run came from. Only completed runs enter the
statistics; running, failed and pending runs are listed with their status and error.

Writes into DIR::

    index.html     one self-contained page: CSS inline, plots as data: URIs, no script
    report.md      the same tables, plots linked from plots/
    plots/*.png
    summary.json   the groups' statistics for machines; no paths and no wall times, so an
                   interrupted and resumed sweep gives the same file as an uninterrupted one

Inputs: one sweep folder (its ``sweep.json``, written by ``fedmech sweep``), or run folders.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import logging
import math
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedmech_flwr.config import differing_keys, flatten_plain
from fedmech_flwr.errors import BadFileError, ConfigError
from fedmech_flwr.files import write_text_atomic
from fedmech_flwr.plotting import band_plot, heatmap
from fedmech_flwr.run_folder import (
    CONFIG_FILE,
    ENVIRONMENT_FILE,
    PARTITIONS_FILE,
    read_records,
    read_status,
    writer_gone,
)
from fedmech_flwr.stats import mean_ci
from fedmech_flwr.sweep import MANIFEST_FILE, lock_holder
from fedmech_flwr.yaml_text import read_yaml_file

log = logging.getLogger(__name__)

INDEX_FILE, MARKDOWN_FILE, SUMMARY_FILE, PLOTS_DIR = "index.html", "report.md", "summary.json", "plots"
NOT_COMPARED = ("seed", "name", "output_root")
"""Config keys that do not make runs different experiments."""
PER_FIGURE = 10
"""Groups per figure; more are split over several."""


@dataclass(frozen=True)
class Metric:
    label: str
    record: str
    """``eval``, or the name of the diagnostic whose records hold the value."""
    path: tuple[str, ...]
    """Keys into the record."""
    unit: str
    """``%`` and ``pp`` (records hold fractions, shown x 100), ``IoU`` and ``R^2`` (as is)."""
    decimals: int = 1
    empty: tuple[str, ...] | None = None
    """Keys to the count of empty circuits, reported next to an IoU."""

    def display(self, value: float) -> float:
        return 100 * value if self.unit in ("%", "pp") else value


def _misalignment(label: str, key: str) -> Metric:
    return Metric(label, "misalignment", (key, "accuracy"), "%")


def _circuit_iou(label: str, key: str) -> Metric:
    return Metric(label, "circuits", ("mean", key), "IoU", 2, ("empty", key))


METRICS: dict[str, Metric] = {
    "eval.accuracy": Metric("global test accuracy", "eval", ("accuracy",), "%"),
    "eval.sparsity": Metric("actual sparsity", "eval", ("sparsity",), "%", 2),
    "misalignment.global": _misalignment("global", "global"),
    "misalignment.probe": _misalignment("probe", "probe"),
    "misalignment.realigned": _misalignment("realigned (val-selected)", "realigned"),
    "misalignment.realigned_test_selected": _misalignment("realigned (test-selected)", "realigned_test_selected"),
    "misalignment.ncm": _misalignment("NCM", "ncm"),
    "misalignment.ccvr": _misalignment("CCVR", "ccvr"),
    "misalignment.tau_norm": _misalignment("tau-norm", "tau_norm"),
    "misalignment.gaps.probe": Metric("probe − global", "misalignment", ("gaps", "probe"), "pp"),
    "misalignment.gaps.realigned": Metric("realigned − global", "misalignment", ("gaps", "realigned"), "pp"),
    "circuits.intra_client": _circuit_iou("intra-client", "intra_client"),
    "circuits.inter_client": _circuit_iou("inter-client", "inter_client"),
    "circuits.local_to_global": _circuit_iou("local-to-global", "local_to_global"),
    "usae.overlap": Metric("shared / alive concepts (fires once)", "usae", ("overlap", "fires_once", "overlap"), "%"),
    "usae.overlap_thresholded": Metric("shared / alive concepts (above threshold)", "usae",
                                       ("overlap", "thresholded", "overlap"), "%"),
    "usae.r2_cross_mean": Metric("mean cross reconstruction", "usae", ("r2_cross_mean",), "R^2", 2),
}
"""Every number the report summarises, keyed as in summary.json and the paper-values file;
values are in the unit shown (percent, percentage points, IoU or R^2)."""

TABLES = {"eval": "Global model", "misalignment": "Preserved or misaligned (misalignment diagnostic)",
          "circuits": "Circuit IoU (circuits diagnostic)", "usae": "Universal SAE (usae diagnostic)"}
CURVES = [("accuracy", "eval.accuracy", (0.0, 100.0)), ("probe_gap", "misalignment.gaps.probe", None),
          *[(f"circuits_{k}", f"circuits.{k}", (0.0, 1.05)) for k in ("intra_client", "inter_client",
                                                                        "local_to_global")]]
"""Per-round figures: file stem, metric, y range."""
RELATIONS = ("=", "≈", "<", ">")
_ABSENT = object()


# --- runs, sweeps and groups ------------------------------------------------------------


@dataclass
class Run:
    """One run folder, or a sweep cell that has none yet."""

    name: str
    path: Path
    status: str
    seed: int | None = None
    config: dict[str, Any] | None = None
    group: str | None = None
    """The sweep's group name (None for run folders given directly)."""
    axes: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    seconds: float | None = None
    commit: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    class_names: list[str] | None = None

    def records_of(self, source: str) -> list[dict[str, Any]]:
        if source == "eval":
            return [r for r in self.records if r["kind"] == "eval"]
        return [r for r in self.records if r["kind"] == "diagnostic" and r.get("name") == source]


@dataclass
class Stat:
    """A metric of one group at its runs' final rounds."""

    mean: float | None
    half_width: float | None
    """None with one value (no interval) or none."""
    n: int
    """Runs with a defined value."""
    undefined: int = 0
    """Runs whose value is undefined (null or NaN, e.g. the IoU of two empty circuits)."""
    empty: int | None = None
    """Empty circuits, summed over the runs (IoUs only)."""
    rounds: list[int] = field(default_factory=list)
    """The final rounds the values come from."""


@dataclass
class Group:
    label: str
    axes: dict[str, str]
    config: dict[str, Any]
    """The runs' config without ``NOT_COMPARED`` keys."""
    runs: list[Run]
    stats: dict[str, Stat] = field(default_factory=dict)

    @property
    def completed(self) -> list[Run]:
        return [r for r in self.runs if r.status == "completed"]

    @property
    def partial(self) -> bool:
        return len(self.completed) < len(self.runs)

    @property
    def runs_text(self) -> str:
        done, total = len(self.completed), len(self.runs)
        return f"{done} of {total} completed" + (" (partial)" if 0 < done < total else "")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _seconds_between(start: str, end: str) -> float:
    return (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()


def _open_run(run: Run, claimed: str | None = None) -> None:
    """Fill ``run`` from its folder: status, config, commit, wall time; records if it
    completed. The folder's status.json is the truth, but a run whose writer is gone from
    this host while it still says running was interrupted (the error says how to
    continue it), and a sweep cell keeps the manifest's word (failed, interrupted by
    Ctrl-C, SIGTERM or a kill of its sweep, or running before its folder has a status)
    until it runs again."""
    if (run.path / CONFIG_FILE).is_file():
        run.config = read_yaml_file(run.path / CONFIG_FILE)
    status = read_status(run.path)
    if status["status"] == "missing":
        run.status = claimed if claimed in ("failed", "interrupted", "running") else "pending"
        return
    run.status = status["status"]
    if run.status != "completed" and claimed in ("failed", "interrupted"):
        run.status = claimed
    elif writer_gone(status):
        run.status = "interrupted"
        run.error = ("its process ended without recording an outcome; continue it with "
                     f"`fedmech run --resume {run.path}`")
    if run.status != "completed":
        run.error = status.get("error") or run.error
    env_file = run.path / ENVIRONMENT_FILE
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    if commit := env.get("git", {}).get("commit"):
        run.commit = commit[:12] + (" (dirty)" if env["git"].get("dirty") else "")
    if run.seconds is None and env.get("started_at") and run.status in ("completed", "failed") and status.get("updated_at"):
        run.seconds = _seconds_between(env["started_at"], status["updated_at"])
    if run.status == "completed":
        run.records = read_records(run.path)
        parts = run.path / PARTITIONS_FILE
        run.class_names = json.loads(parts.read_text())["class_names"] if parts.is_file() else None


def read_sweep(sweep_dir: Path) -> tuple[dict[str, Any], list[Run]]:
    """The manifest of a sweep folder and its cells as runs (``run_dir`` is relative to
    the folder; a cell without a folder is pending)."""
    path = sweep_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        runs = [Run(name=cell["name"], path=sweep_dir / cell["run_dir"], status="pending", seed=cell.get("seed"),
                    config=cell.get("config"), group=cell["group"], axes={k: _text(v) for k, v in cell["axes"].items()},
                    error=cell.get("error"), seconds=cell.get("seconds"))
                for cell in manifest["cells"]]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise BadFileError(
            f"{path}: expected the manifest `fedmech sweep` writes (cells with name, group, axes and run_dir); "
            f"could not read it ({err!r}); run the sweep again, or pass its run folders instead"
        ) from err
    sweep_alive = lock_holder(sweep_dir) is not None
    for run, cell in zip(runs, manifest["cells"]):
        claimed = cell.get("status")
        if claimed == "running" and not sweep_alive:
            claimed = "interrupted"
            run.error = "its sweep was killed; run the same `fedmech sweep` command again to continue it"
        _open_run(run, claimed)
    return manifest, runs


def _read_run(path: Path) -> Run:
    run = Run(name=path.name, path=path, status="pending")
    _open_run(run)
    if run.config is None:
        raise ConfigError(f"{path} has no {CONFIG_FILE}: pass run folders that `fedmech run` made, or a sweep folder")
    run.seed = run.config.get("seed")
    if run.status == "pending":
        run.status = "unknown"  # no status.json
    return run


def read_inputs(paths: list[Path]) -> tuple[dict[str, Any] | None, list[Run]]:
    """The sweep manifest (None for run folders) and the runs the paths name."""
    sweeps = [p for p in paths if (p / MANIFEST_FILE).is_file()]
    if sweeps and len(paths) > 1:
        raise ConfigError(f"give one sweep folder or several run folders, not both (got {len(paths)} paths, "
                          f"{len(sweeps)} sweep folder(s)); run the report once per sweep", "fedmech report")
    if sweeps:
        return read_sweep(sweeps[0])
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a folder: pass a sweep folder (with {MANIFEST_FILE}) or run folders")
    return None, [_read_run(p) for p in paths]


def _stripped(config: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (config or {}).items() if k not in NOT_COMPARED}


def _component(flat: dict[str, Any], key: str) -> str | None:
    """The plug-in entry (a mapping with a ``name``) that holds dotted ``key``."""
    parts = key.split(".")
    return next((p for i in range(len(parts) - 1, 0, -1) if f"{(p := '.'.join(parts[:i]))}.name" in flat), None)


def _describe_axes(configs: list[dict[str, Any]], keys: list[str]) -> list[dict[str, str]]:
    """Per config, the differing keys as readable axes: a plug-in entry as
    ``name(param=value)`` with only its differing params (``dirichlet(alpha=0.05)``)."""
    flat = [flatten_plain(c) for c in configs]
    owners: dict[str, list[str]] = {}
    for key in keys:
        owner = next((c for f in flat if (c := _component(f, key))), key)
        owners.setdefault(owner, []).append(key)
    out = []
    for f in flat:
        axes = {}
        for owner, owned in owners.items():
            if owner in owned:
                axes[owner] = _text(f.get(owner))
            elif f"{owner}.name" not in f:
                axes[owner] = "none"
            else:
                params = [f"{k[len(owner) + 1:]}={_text(f[k])}" for k in owned if k != f"{owner}.name" and k in f]
                axes[owner] = f[f"{owner}.name"] + (f"({', '.join(params)})" if params else "")
        out.append(axes)
    return out


def make_groups(manifest: dict[str, Any] | None, runs: list[Run]) -> list[Group]:
    """Runs that differ only by seed, as groups: the sweep's groups (in its order, named
    and labelled by its manifest), else by config, named by the keys that differ."""
    by_key: dict[str, list[Run]] = {}
    for run in runs:
        key = run.group if manifest is not None else json.dumps(_stripped(run.config), sort_keys=True)
        by_key.setdefault(key, []).append(run)
    configs = [_stripped(next((r.config for r in members if r.config), None)) for members in by_key.values()]
    if manifest is not None:
        return [Group(key, members[0].axes, config, members)
                for (key, members), config in zip(by_key.items(), configs)]
    axes = _describe_axes(configs, differing_keys(configs))
    groups = []
    for members, config, ax in zip(by_key.values(), configs, axes):
        label = ", ".join(f"{k}={v}" for k, v in ax.items()) or str(members[0].config.get("name", "all runs"))
        groups.append(Group(label, ax, config, members))
    return sorted(groups, key=lambda g: g.label)


# --- statistics -------------------------------------------------------------------------


def _lookup(record: dict[str, Any], path: tuple[str, ...]) -> Any:
    """A record's value at ``path``: ``_ABSENT`` when the record lacks the first key (not
    measured in that run); None when a deeper key is missing or the value is null or NaN."""
    if path[0] not in record:
        return _ABSENT
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def group_stat(metric: Metric, runs: list[Run], confidence: float = 0.95) -> Stat | None:
    """``metric`` at each run's last record holding it, over the runs; None when no run
    measured it. Undefined values are counted, never averaged."""
    values, undefined, empty, rounds, measured = [], 0, 0, set(), False
    for run in runs:
        records = run.records_of(metric.record)
        if not records:
            continue
        last = max(records, key=lambda r: r["round"])
        value = _lookup(last, metric.path)
        if value is _ABSENT:
            continue
        measured = True
        rounds.add(last["round"])
        if metric.empty and isinstance(count := _lookup(last, metric.empty), float):
            empty += int(count)
        if value is None:
            undefined += 1
        else:
            values.append(metric.display(value))
    if not measured:
        return None
    mean, half, n = mean_ci(values, confidence) if values else (None, None, 0)
    return Stat(mean, half, n, undefined, empty if metric.empty else None, sorted(rounds))


def _number(metric: Metric, value: float, signed: bool = False) -> str:
    return f"{value:{'+' if signed else ''}.{metric.decimals}f}"


def format_stat(metric: Metric, stat: Stat | None) -> str:
    """``71.2 ± 3.1 (n=3)``; ``+21.7 ± 2.0 pp (n=3)`` for gaps; ``undefined (4 empty)`` when
    empty circuits leave no IoU; ``undefined in 3 runs`` otherwise (e.g. an intra-client IoU
    when circuits ran in one round only)."""
    if stat is None:
        return "–"
    empty = f", {stat.empty} empty" if stat.empty is not None else ""
    if stat.mean is None:
        return f"undefined ({stat.empty} empty)" if stat.empty else f"undefined in {stat.undefined} runs"
    unit = " pp" if metric.unit == "pp" else ""
    text = _number(metric, stat.mean, signed=metric.unit == "pp")
    text += f" ± {_number(metric, stat.half_width)}{unit} (n={stat.n})" if stat.half_width is not None \
        else f"{unit} (n=1, no interval)"
    return text + (f", {stat.undefined} undefined" if stat.undefined else "") + empty


# --- published values -------------------------------------------------------------------


@dataclass(frozen=True)
class PaperValue:
    metric: str
    value: float
    """In the report's unit for ``metric``."""
    relation: str
    where: dict[str, Any]
    """Dotted config keys a group must have these values of."""
    source: dict[str, Any]
    """``file``, ``quote`` and optionally ``version`` and ``note``."""

    def matches(self, config: dict[str, Any]) -> bool:
        flat = flatten_plain(config)
        return all(flat.get(key, _ABSENT) == value for key, value in self.where.items())


def read_paper_values(path: Path) -> list[PaperValue]:
    """The published values of a YAML file (``values: [{metric, value, relation, where, source}]``)."""
    raw = read_yaml_file(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("values"), list):
        raise ConfigError("expected a mapping with a 'values' list", str(path))
    out = []
    for i, item in enumerate(raw["values"]):
        where = f"{path}: values[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"expected a mapping with metric, value, relation, where and source, got {item!r}", where)
        if item.get("metric") not in METRICS:
            raise ConfigError(f"unknown metric {item.get('metric')!r}; use one of {', '.join(METRICS)}",
                              f"{where}.metric")
        if not isinstance(item.get("value"), (int, float)) or isinstance(item.get("value"), bool):
            raise ConfigError(f"value must be a number in the report's unit, got {item.get('value')!r}",
                              f"{where}.value")
        if item.get("relation", "=") not in RELATIONS:
            raise ConfigError(f"relation must be one of {' '.join(RELATIONS)}, got {item.get('relation')!r}",
                              f"{where}.relation")
        if not isinstance(item.get("where", {}), dict):
            raise ConfigError("where must map dotted config keys to values", f"{where}.where")
        source = item.get("source")
        if not isinstance(source, dict) or not {"file", "quote"} <= set(source):
            raise ConfigError("source must be a mapping with file and quote (version and note optional)",
                              f"{where}.source")
        out.append(PaperValue(item["metric"], float(item["value"]), item.get("relation", "="), item.get("where", {}),
                              source))
    return out


@dataclass
class Comparison:
    paper: PaperValue
    group: Group | None
    """None when no group matches and measured the metric."""

    @property
    def stat(self) -> Stat | None:
        return self.group.stats.get(self.paper.metric) if self.group else None

    @property
    def difference(self) -> float | None:
        """Ours minus the paper's, for ``=`` and ``≈``."""
        stat = self.stat
        if self.paper.relation in ("<", ">") or stat is None or stat.mean is None:
            return None
        return stat.mean - self.paper.value

    @property
    def satisfied(self) -> bool | None:
        """Whether our mean meets a ``<`` or ``>`` bound."""
        stat = self.stat
        if self.paper.relation not in ("<", ">") or stat is None or stat.mean is None:
            return None
        return stat.mean < self.paper.value if self.paper.relation == "<" else stat.mean > self.paper.value


def compare(paper: list[PaperValue], groups: list[Group]) -> list[Comparison]:
    out = []
    for value in paper:
        matched = [g for g in groups if value.matches(g.config) and value.metric in g.stats]
        out += [Comparison(value, g) for g in matched] or [Comparison(value, None)]
    return out


# --- plots ------------------------------------------------------------------------------


def _chunks(items: list) -> list[list]:
    """``items`` in as few figures as hold ``PER_FIGURE`` each, evenly filled (12 -> 6 + 6,
    not 10 + 2), so that in a grid the figures follow its axes where they can."""
    parts = max(1, math.ceil(len(items) / PER_FIGURE))
    size = math.ceil(len(items) / parts) if items else 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def _series(metric: Metric, runs: list[Run]) -> tuple[list[tuple[int, float, float, float]], int]:
    """Per round: mean and band (95% CI, or min..max with fewer than two runs); most runs."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for record in run.records_of(metric.record):
            if isinstance(value := _lookup(record, metric.path), float):
                by_round[record["round"]].append(metric.display(value))
    points = []
    for server_round, values in sorted(by_round.items()):
        mean, half, _ = mean_ci(values)
        low, high = (min(values), max(values)) if half is None else (mean - half, mean + half)
        points.append((server_round, mean, low, high))
    return points, max((len(v) for v in by_round.values()), default=0)


def _wrap(label: str, width: int) -> str:
    """A plot label broken into lines, so long group names fit legends and axes."""
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False)) or label


def _file_name(stem: str, part: int, parts: int) -> str:
    return f"{stem}.png" if parts == 1 else f"{stem}_{part}.png"


def plot_curves(groups: list[Group], plots: Path) -> list[tuple[Path, str]]:
    """Per-round curves of the completed runs, one line per group, with seed bands."""
    out = []
    for stem, key, ylim in CURVES:
        metric = METRICS[key]
        lines = {}
        for group in groups:
            points, n = _series(metric, group.completed)
            if points:
                band = "95% CI" if n >= 2 else "min–max"
                lines[_wrap(f"{group.label} (n={n}, {band})", 48)] = points
        chunks = _chunks(list(lines.items()))
        for part, chunk in enumerate(chunks, 1):
            title = f"{metric.label} ({metric.unit}) over rounds, mean over seeds"
            title += f" ({part} of {len(chunks)})" if len(chunks) > 1 else ""
            ylabel = f"{metric.label} ({metric.unit})"
            path = band_plot(dict(chunk), title, ylabel, plots / _file_name(stem, part, len(chunks)), ylim)
            out.append((path, title))
    return out


def plot_per_class(groups: list[Group], plots: Path) -> list[tuple[Path, str]]:
    """Last-round per-class recall (eval ``per_class_accuracy``), mean over seeds; groups
    whose datasets name different classes go to different figures."""
    columns: dict[tuple[str, ...], list[tuple[str, list[float]]]] = defaultdict(list)
    for group in groups:
        rows = []
        for run in group.completed:
            if evals := run.records_of("eval"):
                last = max(evals, key=lambda r: r["round"])
                rows.append([np.nan if v is None else v for v in last["per_class_accuracy"]])
        if not rows:
            continue
        recall = np.array(rows, dtype=float)
        names = group.completed[0].class_names or [str(c) for c in range(recall.shape[1])]
        with np.errstate(all="ignore"):
            mean = [float(np.nanmean(col)) if np.isfinite(col).any() else np.nan for col in recall.T]
        columns[tuple(names)].append((group.label, mean))
    out = []
    for index, (names, cols) in enumerate(columns.items(), 1):
        chunks = _chunks(cols)
        for part, chunk in enumerate(chunks, 1):
            stem = "per_class_recall" if len(columns) == 1 else f"per_class_recall_{index}"
            title = "Last-round per-class recall of the global model, mean over seeds"
            matrix = np.array([values for _, values in chunk]).T
            path = heatmap(matrix, [_wrap(label, 24) for label, _ in chunk], list(names), title,
                           plots / _file_name(stem, part, len(chunks)),
                           notes=np.where(np.isfinite(matrix), "", "n/a"), xlabel="group")
            out.append((path, title + (f" ({part} of {len(chunks)})" if len(chunks) > 1 else "")))
    return out


# --- the document: tables rendered as HTML and Markdown ---------------------------------


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: Path
    caption: str


@dataclass
class Section:
    title: str
    blocks: list[str | list[str] | Table | Image]
    """A string is a paragraph, a list of strings a bullet list."""


def _groups_table(groups: list[Group], axes: list[str]) -> Table:
    rows = [[g.label, *[g.axes.get(a, "–") for a in axes],
             ", ".join(str(r.seed) for r in g.runs), g.runs_text] for g in groups]
    return Table(["group", *axes, "seeds", "runs"], rows)


def _metric_tables(groups: list[Group]) -> list[Section]:
    sections = []
    for source, title in TABLES.items():
        keys = [k for k, m in METRICS.items() if m.record == source and any(k in g.stats for g in groups)]
        if not keys:
            continue
        header = ["group", "runs", *[f"{METRICS[k].label} ({METRICS[k].unit})" for k in keys]]
        rows = [[g.label, g.runs_text, *[format_stat(METRICS[k], g.stats.get(k)) for k in keys]] for g in groups]
        sections.append(Section(title, [Table(header, rows)]))
    return sections


def _difference_text(comparison: Comparison) -> str:
    metric = METRICS[comparison.paper.metric]
    if comparison.satisfied is not None:
        return f"{'satisfied' if comparison.satisfied else 'not satisfied'} ({comparison.paper.relation} bound)"
    if comparison.difference is None:
        return "–"
    unit = " pp" if metric.unit in ("%", "pp") else ""
    return _number(metric, comparison.difference, signed=True) + unit


def _paper_section(comparisons: list[Comparison]) -> Section:
    sources = list(dict.fromkeys(json.dumps(c.paper.source, sort_keys=True) for c in comparisons))
    rows = []
    for c in comparisons:
        metric = METRICS[c.paper.metric]
        note = sources.index(json.dumps(c.paper.source, sort_keys=True)) + 1
        rows.append([f"{metric.label} ({metric.unit})", c.group.label if c.group else "no matching group measured it",
                     f"{c.paper.relation} {_number(metric, c.paper.value, metric.unit == 'pp')} [{note}]",
                     format_stat(metric, c.stat) if c.group else "–", _difference_text(c)])
    notes = []
    for i, text in enumerate(sources, 1):
        source = json.loads(text)
        version = f" ({source['version']})" if source.get("version") else ""
        extra = f" — {source['note']}" if source.get("note") else ""
        notes.append(f"[{i}] {source['file']}{version}: “{source['quote']}”{extra}")
    return Section("Published values", [
        "A published value sits next to every group that measured its metric and whose config has all the "
        "values in its `where`. The paper's values come from its protocol (100 rounds, 99.9% sparsity, full "
        "shards); next to a reduced run (a cpu preset) read the direction, not the level. "
        "Ours − paper is in the metric's unit (percentage points for accuracies); a bound says whether our "
        "mean satisfies it.",
        Table(["metric", "group", "paper", "ours (mean ± 95% CI)", "ours − paper"], rows), notes])


def _leaderboard(groups: list[Group], varying: list[str]) -> Section | None:
    """Strategy (name, weighting) + client x partition: final accuracy and probe gap."""
    if not any(k.startswith(("strategy.", "client.")) for k in varying):
        return None
    others = [k for k in varying if not k.startswith(("strategy.", "client.", "data.partition."))]
    cells: dict[str, dict[str, Group]] = defaultdict(dict)
    columns: list[str] = []
    by_strategy = defaultdict(list)
    for g in groups:
        by_strategy[g.config.get("strategy", {}).get("name")].append(g.config)
    # a strategy's row names only the parameters that tell its own rows apart
    own_varying = {name: differing_keys(configs) for name, configs in by_strategy.items()}
    for g in groups:
        flat = flatten_plain(g.config)
        params = [f"{k.split('.', 1)[1]}={_text(flat[k])}" for k in own_varying[flat.get("strategy.name")]
                  if k.startswith("strategy.") and k not in ("strategy.name", "strategy.weighting") and k in flat]
        weighting = [_text(flat["strategy.weighting"])] if "strategy.weighting" in flat else []
        row = f"{flat.get('strategy.name')}({', '.join(weighting + params)}) + {flat.get('client.name')}"
        row += "".join(f", {k}={_text(flat.get(k))}" for k in others)
        partition = [f"{p}={_text(flat[key])}" for p in ("alpha", "k") if (key := f"data.partition.{p}") in flat]
        column = str(flat.get("data.partition.name")) + (f"({', '.join(partition)})" if partition else "")
        columns += [column] if column not in columns else []
        cells[row][column] = g
    accuracy, gap = METRICS["eval.accuracy"], METRICS["misalignment.gaps.probe"]

    def score(row: str) -> float:
        means = [s.mean for g in cells[row].values() if (s := g.stats.get("eval.accuracy")) and s.mean is not None]
        return float(np.mean(means)) if means else -math.inf

    rows = []
    for row in sorted(cells, key=lambda r: (-score(r), r)):
        texts = []
        for column in columns:
            g = cells[row].get(column)
            text = format_stat(accuracy, g.stats.get("eval.accuracy")) if g else "–"
            if g and "misalignment.gaps.probe" in g.stats:
                text += f"; gap {format_stat(gap, g.stats['misalignment.gaps.probe'])}"
            texts.append(text)
        rows.append([row, *texts, "–" if score(row) == -math.inf else f"{score(row):.1f}"])
    return Section("Strategy leaderboard", [
        "Final global test accuracy (%) and, where measured, the probe − global gap (pp), mean ± 95% CI over "
        "seeds; rows sorted by the mean over columns.",
        Table(["strategy + client", *columns, "mean over columns (%)"], rows)])


def _wall_time(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.1f} min"


def _provenance(manifest: dict[str, Any] | None, groups: list[Group], varying: list[str], paths: list[Path]) -> Section:
    runs = [r for g in groups for r in g.runs]
    commits = defaultdict(int)
    for run in runs:
        if run.commit:
            commits[run.commit] += 1
    items = [f"Keys that differ between groups: {', '.join(varying) or 'none'}",
             f"Seeds: {', '.join(sorted({str(r.seed) for r in runs}))}",
             "Commits: " + (", ".join(f"{c} ({n} runs)" for c, n in sorted(commits.items())) or "unknown")]
    if manifest is not None:
        items[:0] = [f"Sweep: {manifest.get('name')} ({manifest.get('file')}), "
                     f"preset {manifest.get('preset') or 'none'}, axes {', '.join(manifest.get('axes', [])) or 'none'}"]
    items.append("Inputs: " + ", ".join(str(p) for p in paths))
    table = Table(["run", "group", "seed", "status", "error", "wall time", "commit"],
                  [[r.name, g.label, str(r.seed), r.status, r.error or "", _wall_time(r.seconds), r.commit or "–"]
                   for g in groups for r in g.runs])
    return Section("Runs and provenance", [items, table])


def build_sections(manifest: dict[str, Any] | None, groups: list[Group], comparisons: list[Comparison],
                   images: list[tuple[Path, str]], paths: list[Path]) -> tuple[str, list[Section]]:
    """The report's title and sections, shared by the HTML page and the Markdown file."""
    axes = list(dict.fromkeys(a for g in groups for a in g.axes))
    runs = [r for g in groups for r in g.runs]
    done = sum(r.status == "completed" for r in runs)
    title = f"fedmech report: {manifest.get('name')}" if manifest else "fedmech report"
    varying = differing_keys([g.config for g in groups])
    intro = [f"{len(groups)} groups, {len(runs)} runs, {done} completed. Each number is the mean ± 95% confidence "
             "interval (Student t over seeds) of the runs' values at their final round; n is the number of runs "
             "behind it (n=1: no interval). Only completed runs enter the statistics; the others are listed below. "
             "Accuracies are percent, gaps percentage points (pp); IoUs and R^2 are fractions. An undefined IoU "
             "(two empty circuits) never enters a mean: it is counted, with the empty circuits."]
    left_out = [f"{r.name} (group {g.label}, seed {r.seed}): {r.status}" + (f": {r.error}" if r.error else "")
                for g in groups for r in g.runs if r.status != "completed"]
    sections = [Section("Groups", [*intro, _groups_table(groups, axes)])]
    if left_out:
        sections.append(Section("Runs not in the statistics", [left_out]))
    sections += _metric_tables(groups)
    if comparisons:
        sections.append(_paper_section(comparisons))
    if board := _leaderboard(groups, varying):
        sections.append(board)
    if images:
        sections.append(Section("Plots", ["Curves: mean over the completed runs of each group; the shaded band is "
                                          "the 95% CI (t) per round, or min–max where fewer than two runs."]
                                + [Image(path, caption) for path, caption in images]))
    sections.append(_provenance(manifest, groups, varying, paths))
    return title, sections


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0; } img { max-width: 100%; } figcaption { color: #555; font-size: 13px; }
"""


def to_html(title: str, sections: list[Section]) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
           '<link rel="icon" href="data:,">', f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    for section in sections:
        out.append(f"<h2>{e(section.title)}</h2>")
        for block in section.blocks:
            if isinstance(block, str):
                out.append(f"<p>{e(block)}</p>")
            elif isinstance(block, list):
                out.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in block) + "</ul>")
            elif isinstance(block, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in block.header)
                body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in block.rows)
                out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                data = base64.b64encode(block.path.read_bytes()).decode()
                out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{e(block.caption)}">'
                           f"<figcaption>{e(block.caption)}</figcaption></figure>")
    return "\n".join(out + ["</body></html>", ""])


MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|])")
"""Characters that Markdown would read as code, emphasis, a link or a table cell (``&``,
``<`` and ``>`` become entities; an underscore inside a word is literal already)."""


def markdown_text(text: str) -> str:
    """``text`` as literal Markdown on one line: HTML's special characters as entities and
    Markdown's escaped, so text from runs and values files cannot become HTML, a link or
    a table cell of its own."""
    return MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(" ".join(text.split()), quote=False))


def to_markdown(title: str, sections: list[Section], out_dir: Path) -> str:
    e = markdown_text
    out = [f"# {e(title)}", ""]
    for section in sections:
        out += [f"## {e(section.title)}", ""]
        for block in section.blocks:
            if isinstance(block, str):
                out += [e(block), ""]
            elif isinstance(block, list):
                out += [f"- {e(item)}" for item in block] + [""]
            elif isinstance(block, Table):
                out += ["| " + " | ".join(map(e, block.header)) + " |", "|" + "---|" * len(block.header)]
                out += ["| " + " | ".join(map(e, row)) + " |" for row in block.rows] + [""]
            else:
                out += [f"![{e(block.caption)}]({block.path.relative_to(out_dir).as_posix()})", ""]
    return "\n".join(out)


# --- summary.json and the entry point ---------------------------------------------------


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def summary(manifest: dict[str, Any] | None, groups: list[Group], comparisons: list[Comparison],
            confidence: float) -> dict[str, Any]:
    """What the report says, for machines: no paths, no wall times."""
    def stat(s: Stat | None) -> dict[str, Any] | None:
        return None if s is None else {"mean": _finite(s.mean), "half_width": _finite(s.half_width), "n": s.n,
                                       "undefined": s.undefined, "empty": s.empty, "rounds": s.rounds}

    return {
        "confidence": confidence,
        "interval": "Student t over seeds at each run's final round; completed runs only",
        "metrics": {k: {"label": m.label, "unit": m.unit, "record": m.record, "path": ".".join(m.path)}
                    for k, m in METRICS.items()},
        "sweep": None if manifest is None else {k: manifest.get(k) for k in ("name", "preset", "seeds", "axes")},
        "differing_keys": differing_keys([g.config for g in groups]),
        "groups": [{
            "group": g.label, "axes": g.axes, "runs": len(g.runs), "completed": len(g.completed),
            "partial": g.partial, "cells": [{"name": r.name, "seed": r.seed, "status": r.status} for r in g.runs],
            "stats": {k: stat(s) for k, s in g.stats.items()},
        } for g in groups],
        "paper": [{
            "metric": c.paper.metric, "value": c.paper.value, "relation": c.paper.relation, "where": c.paper.where,
            "group": c.group.label if c.group else None, "ours": stat(c.stat), "difference": _finite(c.difference),
            "satisfied": c.satisfied, "source": c.paper.source,
        } for c in comparisons],
    }


def write_report(paths: list[str | Path], out_dir: str | Path, paper_file: str | Path | None = None,
                 confidence: float = 0.95) -> Path:
    """Write index.html, report.md, plots/ and summary.json for a sweep folder or run
    folders into ``out_dir``; return the path of index.html."""
    paths = [Path(p).expanduser().resolve() for p in paths]
    out_dir = Path(out_dir).expanduser().resolve()
    manifest, runs = read_inputs(paths)
    if not runs:
        raise ConfigError(f"no runs to report on in {', '.join(map(str, paths))}", "fedmech report")
    groups = make_groups(manifest, runs)
    for group in groups:
        group.stats = {k: s for k, m in METRICS.items() if (s := group_stat(m, group.completed, confidence))}
    comparisons = compare(read_paper_values(Path(paper_file)), groups) if paper_file else []
    plots = out_dir / PLOTS_DIR
    images = plot_curves(groups, plots) + plot_per_class(groups, plots)
    title, sections = build_sections(manifest, groups, comparisons, images, paths)
    write_text_atomic(out_dir / MARKDOWN_FILE, to_markdown(title, sections, out_dir))
    write_text_atomic(out_dir / SUMMARY_FILE,
                      json.dumps(summary(manifest, groups, comparisons, confidence), indent=1, allow_nan=False) + "\n")
    index = write_text_atomic(out_dir / INDEX_FILE, to_html(title, sections))
    log.info("report of %d runs in %d groups written to %s", len(runs), len(groups), out_dir)
    return index
