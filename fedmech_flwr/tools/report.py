"""``fedmech report SWEEP_DIR | RUN_DIR ... --out DIR``: one page over many runs.

Runs whose configs differ only by their seed form a group. For each group the report gives
the mean ± 95% confidence interval (Student t over seeds, n shown) of every declared metric
(``fedmech_flwr.outputs``: the global model's, each diagnostic's and the strategy's) at
each run's final round, with the flags of its validity rule: the declared skew figure
first, each group's protocol beside the paper's, per-round curves with seed bands,
per-class recall heatmaps, a strategy leaderboard (when strategies or clients vary),
published values held against the groups they describe (``fedmech_flwr.tools.published``), and
where every run came from. Each run's recorded ``plugins:`` are imported first. Only
completed runs enter the statistics; running, failed and pending runs are listed with their
status and error.

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

from fedmech_flwr import plugins
from fedmech_flwr.config import differing_keys, flatten_plain, load_plugins
from fedmech_flwr.errors import BadFileError, ConfigError
from fedmech_flwr.files import write_text_atomic
from fedmech_flwr.outputs import (
    ABSENT,
    DEGENERATE_FRACTION,
    Metric,
    declarations,
    declared,
    latest,
    lookup,
    per_class_values,
    records_of,
)
from fedmech_flwr.plotting import LevelPanel, band_plot, heatmap, level_plot
from fedmech_flwr.run_folder import (
    CONFIG_FILE,
    ENVIRONMENT_FILE,
    PARTITIONS_FILE,
    read_records,
    read_status,
    writer_gone,
)
from fedmech_flwr.stats import difference_ci, mean_ci
from fedmech_flwr.tools.published import PaperValue, PaperValues, Verdict, read_paper_values, verdict
from fedmech_flwr.tools.sweep import MANIFEST_FILE, lock_holder
from fedmech_flwr.yaml_text import read_yaml_file

log = logging.getLogger(__name__)

INDEX_FILE, MARKDOWN_FILE, SUMMARY_FILE, PLOTS_DIR = "index.html", "report.md", "summary.json", "plots"
NOT_COMPARED = ("seed", "name", "output_root")
"""Config keys that do not make runs different experiments."""
PER_FIGURE = 10
"""Groups per figure; more are split over several."""
MIN_CURVE_ROUNDS = 3
"""A declared curve of a metric measured at fewer rounds is not drawn (the tables show it)."""
PROTOCOL = [("clients", "federation.num_clients"), ("rounds", "federation.num_rounds"),
            ("local epochs", "train.epochs"), ("samples per client round", "train.max_samples_per_round"),
            ("sparsity target", "pruning.target_sparsity")]
"""A group's protocol on the page: label and config key; the model, the actual sparsity and
the seeds follow, and the published values' protocols may add keys."""
NULL_SETTINGS = {"train.max_samples_per_round": "full shards"}
"""What a null protocol setting means, where it is not "none"."""
AXIS_NAMES = {"data.dataset": "dataset", "data.partition": "label skew", "pruning.mode": "pruning",
              "pruning.target_sparsity": "sparsity target", "federation.num_rounds": "rounds",
              "federation.num_clients": "clients", "train.epochs": "local epochs", "train.lr": "learning rate"}
"""Readable names of config keys used as axes; others show their last component."""
DEGENERATE_NOTE = (f"⚑ one class k/n: in k of the n seeds the model predicts one class for more than "
                   f"{DEGENERATE_FRACTION:.0%} of the test images; its column averages such predictors")


def axis_name(key: str) -> str:
    """A sweep axis (``data.partition+pruning.mode``) as a column header (``label skew + pruning``)."""
    return " + ".join(AXIS_NAMES.get(part, part.rsplit(".", 1)[-1].replace("_", " ")) for part in key.split("+"))


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
        return records_of(self.records, source)


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
    flags: dict[str, int] = field(default_factory=dict)
    """Per flag of the metric's validity rule, how many runs' values carry it."""
    values: dict[str, float] = field(default_factory=dict)
    """The defined values by run name (to pair two metrics of the same runs)."""

    @property
    def measured(self) -> int:
        return self.n + self.undefined

    @property
    def flag_text(self) -> str | None:
        """``one class in 3/3 seeds``; None when no run is flagged."""
        return "; ".join(f"{flag} in {count}/{self.measured} seeds" for flag, count in self.flags.items()) or None


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
    """A run folder; one that its run left before saving its config (killed or failed at
    start) has its status alone."""
    run = Run(name=path.name, path=path, status="pending")
    _open_run(run)
    if run.config is None and run.status == "pending":
        raise ConfigError(f"{path} has no {CONFIG_FILE}: pass run folders that `fedmech run` made, or a sweep folder")
    run.config = run.config or {}
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
        label = ", ".join(f"{axis_name(k)}={v}" for k, v in ax.items()) or str(members[0].config.get("name", "all runs"))
        groups.append(Group(label, ax, config, members))
    return sorted(groups, key=lambda g: g.label)


# --- statistics -------------------------------------------------------------------------


def group_stat(metric: Metric, runs: list[Run], confidence: float = 0.95) -> Stat | None:
    """``metric`` at each run's last record holding it, over the runs; None when no run
    measured it. Undefined values are counted, never averaged; flagged values are
    averaged and counted per flag, so that every place showing the mean can say so."""
    values, undefined, empty, rounds, flags = {}, 0, 0, set(), defaultdict(int)
    measured = False
    for run in runs:
        if (found := latest(metric, run.records)) is None:
            continue
        measured = True
        last, value, flag = found
        rounds.add(last["round"])
        if metric.empty and isinstance(count := lookup(last, metric.empty), float):
            empty += int(count)
        if flag:
            flags[flag] += 1
        if value is None:
            undefined += 1
        else:
            values[run.name] = metric.display(value)
    if not measured:
        return None
    mean, half, n = mean_ci(values.values(), confidence) if values else (None, None, 0)
    return Stat(mean, half, n, undefined, empty if metric.empty else None, sorted(rounds), dict(flags), values)


def _number(metric: Metric, value: float, signed: bool = False) -> str:
    """``value`` at the metric's decimals; one that rounds to zero is 0, never -0."""
    value = round(value, metric.decimals) + 0.0
    return f"{value:{'+' if signed else ''}.{metric.decimals}f}"


def format_stat(metric: Metric, stat: Stat | None) -> str:
    """``71.2 ± 3.1 (n=3)``; ``+21.7 ± 2.0 pp (n=3)`` for gaps; ``undefined (4 empty)`` when
    empty circuits leave no IoU; ``undefined in 3 runs`` otherwise (e.g. an intra-client IoU
    when circuits ran in one round only); flags follow the value (``10.0 ± 0.0 (n=3) ⚑ one
    class in 3/3 seeds``)."""
    if stat is None:
        return "–"
    empty = f", {stat.empty} empty" if stat.empty is not None else ""
    if stat.mean is None:
        text = f"undefined ({stat.empty} empty)" if stat.empty else f"undefined in {stat.undefined} runs"
        return text + (f" ⚑ {stat.flag_text}" if stat.flag_text else "")
    unit = " pp" if metric.unit == "pp" else ""
    text = _number(metric, stat.mean, signed=metric.unit == "pp")
    text += f" ± {_number(metric, stat.half_width)}{unit} (n={stat.n})" if stat.half_width is not None \
        else f"{unit} (n=1, no interval)"
    text += (f", {stat.undefined} undefined" if stat.undefined else "") + empty
    return text + (f" ⚑ {stat.flag_text}" if stat.flag_text else "")


# --- published values -------------------------------------------------------------------


@dataclass
class Comparison:
    """A published value next to a group that measured its metric (``group`` None: no group did)."""

    paper: PaperValue
    group: Group | None = None
    same_protocol: bool = False
    check: str = ""
    """What is tested: the bound, or the value's direction ("> 0", "> global of the same runs")."""
    result: Verdict | None = None
    shown: tuple[float, float | None] | None = None
    """The tested quantity's mean and 95% half-width (a difference for directions)."""
    difference: float | None = None
    """Ours minus the paper's, only at the paper's protocol for = and ≈."""

    @property
    def stat(self) -> Stat | None:
        return self.group.stats.get(self.paper.metric) if self.group else None


def _control(group: Group, than: dict[str, Any], groups: list[Group]) -> Group | None:
    """The group that differs from ``group`` only under the parents of ``than``'s keys and
    has ``than``'s values there (the IID control of an alpha 0.05 group)."""
    parents = tuple(key.rsplit(".", 1)[0] + "." for key in than)

    def rest(config: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in flatten_plain(config).items() if not k.startswith(parents)}

    own = rest(group.config)
    return next((g for g in groups if g is not group and rest(g.config) == own
                 and all(flatten_plain(g.config).get(k, ABSENT) == v for k, v in than.items())), None)


def _flags(*stats: tuple[str, Stat | None]) -> str | None:
    """The flags of the values a check rests on, each named by whose it is."""
    return "; ".join(f"{who}{t}" for who, s in stats if s and (t := s.flag_text)) or None


def _judge(paper: PaperValue, group: Group, groups: list[Group], same: bool) -> Comparison:
    """The bound or the direction of ``paper`` held against ``group``'s interval."""
    metrics = declared()
    metric, stat = metrics[paper.metric], group.stats[paper.metric]
    out = Comparison(paper, group, same)
    if paper.relation in ("<", ">"):
        out.check = f"{paper.relation} {_number(metric, paper.value)} (bound)"
        out.shown = (stat.mean, stat.half_width) if stat.mean is not None else None
        out.result = verdict(paper.relation, paper.value, stat.mean, stat.half_width, stat.flag_text)
        return out
    if same and stat.mean is not None:
        out.difference = stat.mean - paper.value
    direction = paper.direction
    if direction is None:
        out.check = "none: a level only"
        if not same:
            out.result = Verdict(None, "not compared: a level, at another protocol")
        return out
    out.check = direction.describe(lambda key: metrics[key].label)
    other, whose = None, ""
    if direction.than is not None:
        mean, half = stat.mean, stat.half_width
    elif direction.than_metric:
        other, whose = group.stats.get(direction.than_metric), f"{metrics[direction.than_metric].label}: "
        paired = [v - other.values[run] for run, v in stat.values.items() if other and run in other.values]
        mean, half, _ = mean_ci(paired) if paired else (None, None, 0)
    else:
        control = _control(group, direction.than_group, groups)
        other = control.stats.get(paper.metric) if control else None
        whose = f"control {control.label}: " if control else ""
        if control:
            out.check = f"{direction.relation} the same metric in {control.label} (control)"
        if other is None or not other.values or not stat.values:
            out.result = Verdict(None, "not shown: no control group measured it")
            return out
        mean, half = difference_ci(stat.values.values(), other.values.values())
    out.shown = (mean, half) if mean is not None else None
    bound = direction.than if direction.than is not None else 0.0
    out.result = verdict(direction.relation, bound, mean, half, _flags(("", stat), (whose, other)))
    return out


def compare(paper: PaperValues, groups: list[Group]) -> tuple[list[Comparison], list[PaperValue]]:
    """Each published value held against every group that matches its ``where`` and
    measured its metric; and the values no group measured."""
    out, unmatched = [], []
    for value in paper.values:
        matched = [g for g in groups if value.matches(g.config) and value.metric in g.stats]
        out += [_judge(value, g, groups, paper.same_protocol(value, g.config)) for g in matched]
        unmatched += [] if matched else [value]
    return out, unmatched


# --- the verdict: a label-skewed group against its IID control --------------------------

IID = {"data.partition.name": "iid"}
"""Where a label-skewed group's control differs from it: the same runs on an IID split."""


def _skew_keys() -> list[str]:
    """The first declared ``by_skew`` metrics: the model's own accuracy, then readouts of
    the same model's features (the misalignment diagnostic's global, probe, realigned)."""
    return next(([f"{record}.{k}" for k in outputs.by_skew] for record, outputs in declarations().items()
                 if outputs.by_skew), [])


def skew_pairs(groups: list[Group]) -> list[tuple[Group, Group]]:
    """(label-skewed group, its IID control) pairs that measured the ``by_skew`` metrics,
    the most skewed first."""
    keys = _skew_keys()
    pairs = [(g, c) for g in groups
             if flatten_plain(g.config).get("data.partition.name") != "iid"
             and (c := _control(g, IID, groups)) is not None
             and keys and all(k in g.stats and k in c.stats for k in keys)]
    return sorted(pairs, key=lambda pair: _skew_level(pair[0].config)[0], reverse=True)


def _level(stat: Stat, unit: str) -> str:
    """``57.0%``, or ``57.0 ± 2.1%`` over several seeds; ``undefined``."""
    if stat.mean is None:
        return "undefined"
    return f"{stat.mean:.1f}" + (f" ± {stat.half_width:.1f}" if stat.half_width is not None else "") + unit


def _gaps(stats: dict[str, Stat], readout: str, model: str) -> list[float]:
    """Per run, readout minus the model's own accuracy (the same run's two values)."""
    own, read = stats[model].values, stats[readout].values
    return [read[name] - own[name] for name in own if name in read]


def _points(values: list[float]) -> str:
    mean, half, _ = mean_ci(values)
    return f"{mean:+.1f}" + (f" ± {half:.1f}" if half is not None else "") + " pp"


def skew_verdict(groups: list[Group]) -> list[str]:
    """At most five lines for someone new: the most skewed group's model accuracy and its
    readouts (probe, realigned head) each beside its IID control, one-class models said to
    be so, and what the numbers support: a claim only where the intervals over seeds do
    not overlap zero; one seed is said to be one. Empty without a skewed group and its
    control."""
    pairs = skew_pairs(groups)
    if not pairs:
        return []
    skewed, control = pairs[0]
    metrics, (model, *readouts) = declared(), _skew_keys()
    n = min(s.n for g in (skewed, control) for k in (model, *readouts) if (s := g.stats[k]))
    seeds = ("one seed, so no interval (--seeds 0,1,2 gives intervals)" if n <= 1
             else f"{n} seeds each, mean ± 95% interval")
    more = f"; {len(pairs) - 1} more on the page" if len(pairs) > 1 else ""
    lines = [f"Label skew ({_skew_level(skewed.config)[1]}) against its IID control, {seeds}{more}:"]
    width = max(len(metrics[k].doc or metrics[k].label) for k in (model, *readouts))
    for key in (model, *readouts):
        metric, s, c = metrics[key], skewed.stats[key], control.stats[key]
        unit = "%" if metric.unit == "%" else f" {metric.unit}"
        line = f"  {metric.doc or metric.label:<{width}}  {_level(s, unit)} skewed | {_level(c, unit)} IID"
        for who, stat in (("skewed", s), ("IID", c)):
            if stat.flag_text:
                line += f" ⚑ {who}: {stat.flag_text}"
            if "one class" in stat.flags:
                line += f" (it predicts one class for over {DEGENERATE_FRACTION:.0%} of the test images)"
        lines.append(line)
    lines.append(_reading(skewed, control, model, readouts, n))
    return lines


def _reading(skewed: Group, control: Group, model: str, readouts: list[str], n: int) -> str:
    """The one sentence the numbers support: how far each readout of the same features
    lies above the model's own accuracy, skewed beside IID; the first readout (the probe)
    decides the claim, made only where the two groups' intervals are apart."""
    metrics = declared()
    gaps = [(_gaps(skewed.stats, r, model), _gaps(control.stats, r, model)) for r in readouts]
    if not readouts or not all(s and c for s, c in gaps):
        return "  No reading: a value is undefined (see the page)."
    numbers = "; ".join(f"{metrics[r].label} − {metrics[model].label} {_points(s)} skewed vs {_points(c)} IID"
                        for r, (s, c) in zip(readouts, gaps))
    diff, half = difference_ci(*gaps[0])
    if n <= 1:
        wider = "widened" if diff > 0 else "narrowed"
        return (f"  → {numbers}. In this one seed skew {wider} the gap between what the features carry and what "
                f"the head reads by {abs(diff):.1f} pp; one seed is not evidence: rerun with --seeds 0,1,2.")
    if half is not None and diff - half > 0:
        return f"  → the features kept what the head stopped reading: {numbers} (intervals apart)."
    return f"  → no evidence at n={n} that skew cost the head more than the features: {numbers}."


# --- plots ------------------------------------------------------------------------------


def _chunks(items: list) -> list[list]:
    """``items`` in as few figures as hold ``PER_FIGURE`` each, evenly filled (12 -> 6 + 6,
    not 10 + 2), so that in a grid the figures follow its axes where they can."""
    parts = max(1, math.ceil(len(items) / PER_FIGURE))
    size = math.ceil(len(items) / parts) if items else 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def _series(metric: Metric, runs: list[Run]) -> tuple[list[tuple[int, float, float, float]], int, dict[int, str]]:
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
    """Per-round curves of the completed runs, one line per group, with seed bands and
    flagged rounds ringed; none for a metric measured at fewer than ``MIN_CURVE_ROUNDS``."""
    out = []
    metrics = declared()
    for key in (f"{record}.{k}" for record, outputs in declarations().items() for k in outputs.curves):
        metric, stem = metrics[key], key.replace(".", "_")
        lines, flags = {}, {}
        for group in groups:
            points, n, flagged = _series(metric, group.completed)
            if points:
                band = "95% CI" if n >= 2 else "min–max"
                label = _wrap(f"{group.label} (n={n}, {band})", 48)
                lines[label], flags[label] = points, flagged
        if max((len(points) for points in lines.values()), default=0) < MIN_CURVE_ROUNDS:
            continue
        chunks = _chunks(list(lines.items()))
        for part, chunk in enumerate(chunks, 1):
            title = f"{metric.label} ({metric.unit}) over rounds, mean over seeds"
            title += f" ({part} of {len(chunks)})" if len(chunks) > 1 else ""
            ylabel = f"{metric.label} ({metric.unit})"
            flagged = {label: set(flags[label]) for label, _ in chunk if flags[label]}
            names = sorted({name for label, _ in chunk for name in flags[label].values()})
            path = band_plot(dict(chunk), title, ylabel, plots / _file_name(stem, part, len(chunks)), metric.limits,
                             flagged=flagged, flag_label=", ".join(names) + " (ringed)")
            out.append((path, title))
    return out


def _skew_level(config: dict[str, Any]) -> tuple[tuple, str]:
    """A group's label-skew level, as a sort key and a tick label: IID first, then
    Dirichlet by falling alpha, then other partitions by name."""
    flat = flatten_plain(config)
    name = flat.get("data.partition.name")
    if name == "iid":
        return (0, 0.0, ""), "IID"
    if name == "dirichlet" and isinstance(alpha := flat.get("data.partition.alpha"), (int, float)):
        return (1, -alpha, ""), f"α={alpha:g}"
    label = _describe_axes([config], [k for k in flat if k.startswith("data.partition.")])[0].get("data.partition")
    return (2, 0.0, str(label)), str(label)


def _is_control(config: dict[str, Any]) -> bool:
    """A dense control: the same run without pruning."""
    return flatten_plain(config).get("pruning.mode") == "dense"


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
        levels = sorted({_skew_level(g.config) for g in members})
        index = {label: i for i, (_, label) in enumerate(levels)}
        flat = flatten_plain(members[0].config)
        title = ", ".join(f"{axis_name(k)} {v}" for k, v in members[0].axes.items()
                          if "data.partition" not in k and "pruning.mode" not in k) \
            or f"{flat.get('data.dataset.name')}, {flat.get('model.name')}"
        panel = LevelPanel(title, [label for _, label in levels])
        with_control = len({_is_control(g.config) for g in members}) == 2  # dense runs beside pruned ones
        for g in members:
            level = index[_skew_level(g.config)[1]]
            for key in keys:
                if (stat := g.stats.get(key)) and stat.mean is not None:
                    panel.series.setdefault((metrics[key].label, with_control and _is_control(g.config)), []).append(
                        (level, stat.mean, stat.half_width, _short_flags(stat)))
        for c in comparisons:
            if c.group in members and c.paper.metric in keys and c.paper.relation in ("=", "≈"):
                point = (index[_skew_level(c.group.config)[1]], c.paper.value, metrics[c.paper.metric].label)
                panel.published += [point] if point not in panel.published else []
                same.add(c.same_protocol)
        drawn.append(panel)
    protocol = "at the same protocol" if same == {True} else "at another protocol: read the direction, not the level"
    label = f"published ({paper.paper}), {protocol}" if paper else "published"
    path = level_plot(drawn, "label skew", "test accuracy (%)", plots / "headline.png", _wrap(label, 34), "dense control",
                      ylim=(0.0, 100.0))
    caption = (f"{', '.join(metrics[k].label for k in keys)} accuracy against label skew: mean and 95% "
               "interval over seeds (n in the tables below)")
    if any(control for p in drawn for _, control in p.series):
        caption += "; hollow squares and dashed lines: the dense control"
    if any(point[3] for p in drawn for points in p.series.values() for point in points):
        caption += ("; red rings: values flagged by their validity rule (e.g. a one-class model, which predicts one "
                    f"class for more than {DEGENERATE_FRACTION:.0%} of the test images, so its accuracy is chance, "
                    "not a measurement)")
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
    return Table(["group", *map(axis_name, axes), "seeds", "runs"], rows)


def _setting(value: Any, key: str = "") -> str:
    """A protocol setting as a reader writes it (a plug-in: its name and parameters)."""
    if value is None:
        return NULL_SETTINGS.get(key, "none")
    if isinstance(value, dict) and "name" in value:
        params = [f"{k} {_text(v)}" for k, v in value.items() if k not in ("name", "stem")]
        return value["name"] + (f" ({', '.join(params)})" if params else "")
    return _text(value)


def _protocol_section(groups: list[Group], paper: PaperValues | None, comparisons: list[Comparison]) -> Section:
    """Each group's protocol, beside the published protocol of each version compared here."""
    compared = {paper.texts[c.paper.text].version for c in comparisons} if paper else set()
    protocols = {v: entries for v, entries in (paper.protocols.items() if paper else []) if v in compared}
    extra = [(e.label, e.key) for entries in protocols.values() for e in entries
             if e.key not in dict(PROTOCOL).values()]
    columns = list(dict.fromkeys(PROTOCOL + extra))
    header = ["", *[label for label, _ in columns], "model", "actual sparsity (%)", "seeds"]
    rows, notes, actual = [], [], declared()["eval.sparsity"]
    for version, entries in protocols.items():
        stated = {e.key: e for e in entries}
        cells = []
        for _, key in columns:
            e = stated.get(key)
            cells.append("–" if e is None else "not stated" if e.value is None else
                         _setting(e.value, key) + (" (inferred)" if e.inferred else ""))
            if e is not None and e.value is not None:
                notes.append(f"{paper.paper} {version}, {e.label} {_setting(e.value, key)}: “{e.quote}”"
                             + (f" — inferred {e.inferred}" if e.inferred else ""))
        rows.append([f"paper {version}", *cells, "–", "–", "–"])
    for g in groups:
        flat = flatten_plain(g.config)
        sparsity = g.stats.get("eval.sparsity")
        cells = [_setting(flat[key], key) if key in flat else "–" for _, key in columns]
        if _is_control(g.config) and "pruning.target_sparsity" in dict(columns).values():
            cells[[key for _, key in columns].index("pruning.target_sparsity")] = "dense"
        rows.append([g.label, *cells, _setting(g.config.get("model")),
                     format_stat(actual, sparsity), ", ".join(str(r.seed) for r in g.runs)])
    blocks: list[str | list[str] | Table | Image] = [Table(header, rows)]
    if protocols:
        blocks.insert(0, "What the paper's public texts state of its protocol (“not stated”: nothing in them), "
                         "then each group's. A published value is compared in points only with a group at the "
                         "paper's protocol (every entry stated and equal); elsewhere in direction only.")
        blocks.append(notes)
    return Section("Protocol", blocks)


def _metric_tables(groups: list[Group]) -> list[Section]:
    sections = []
    metrics = declared()
    for source, outputs in declarations().items():
        keys = [k for k, m in metrics.items() if m.record == source and any(k in g.stats for g in groups)]
        title = outputs.title
        if not keys:
            continue
        header = ["group", "runs", *[f"{metrics[k].label} ({metrics[k].unit})" for k in keys]]
        rows = [[g.label, g.runs_text, *[format_stat(metrics[k], g.stats.get(k)) for k in keys]] for g in groups]
        sections.append(Section(title, [Table(header, rows)]))
    return sections


def _result_text(c: Comparison, metric: Metric) -> str:
    """``holds: +5.1 ± 2.0 pp``: the verdict and the interval it rests on (``metric`` is
    the value's)."""
    if c.result is None:
        return "–"
    if c.shown is None:
        return c.result.text
    mean, half = c.shown
    difference = c.paper.relation not in ("<", ">") and c.paper.direction.than is None
    signed = difference or metric.unit == "pp"
    unit = " pp" if metric.unit == "pp" or (difference and metric.unit == "%") else ""
    interval = _number(metric, mean, signed) + (f" ± {_number(metric, half)}" if half is not None else "") + unit
    return f"{c.result.text} ({interval})"


def _paper_section(comparisons: list[Comparison], unmatched: list[PaperValue], paper: PaperValues) -> Section:
    shown = {id(c.paper) for c in comparisons} | {id(v) for v in unmatched}
    values = [v for v in paper.values if id(v) in shown]
    number = {id(v): i for i, v in enumerate(values, 1)}
    points = any(c.difference is not None for c in comparisons)
    metrics = declared()
    rows = []
    for c in comparisons:
        metric = metrics[c.paper.metric]
        row = [f"{metric.label} ({metric.unit})", c.group.label,
               f"{c.paper.relation} {_number(metric, c.paper.value, metric.unit == 'pp')} [{number[id(c.paper)]}]",
               format_stat(metric, c.stat), c.check, _result_text(c, metric)]
        if points:
            row.append("–" if c.difference is None else _number(metric, c.difference, True)
                       + (" pp" if metric.unit in ("%", "pp") else ""))
        rows.append(row)
    header = ["metric", "group", "paper", "ours (mean ± 95% CI)", "direction or bound checked", "result"]
    header += ["ours − paper (same protocol only)"] if points else []
    blocks: list[str | list[str] | Table | Image] = [] if not rows else [
        "A published value sits next to every group that measured its metric and whose config has all the values "
        "in its `where`. Where the group's protocol differs from the paper's (see Protocol), only the value's "
        "direction is checked, never a difference in points: it holds when the whole 95% interval lies on its "
        "side, does not hold when the whole interval lies on the other, and is not shown otherwise, or when a "
        "value behind it is flagged (⚑). A bound (< or >) is checked the same way.",
        Table(header, rows)]
    if unmatched:
        blocks.append("Not measured by any group here: " + "; ".join(
            f"{metrics[v.metric].label} {v.relation} {_number(metrics[v.metric], v.value)} [{number[id(v)]}]"
            for v in unmatched) + ".")
    notes = []
    for v in values:
        inferred = f" Inferred: {'; '.join(v.inferred)}." if v.inferred else ""
        note = f" {v.note[0].upper()}{v.note[1:]}." if v.note else ""
        notes.append(f"[{number[id(v)]}] {paper.cite(v)}: “{v.quote}”.{inferred}{note}")
    return Section("Published values", [*blocks, notes])


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
    metrics = declared()
    accuracy = metrics["eval.accuracy"]
    headline = [f"{record}.{k}" for record, outputs in declarations().items() if record != "eval"
                for k in outputs.headline]

    def score(row: str) -> float:
        means = [s.mean for g in cells[row].values() if (s := g.stats.get("eval.accuracy")) and s.mean is not None]
        return float(np.mean(means)) if means else -math.inf

    def score_text(row: str) -> str:
        """The row's mean, flagged when a value behind it is."""
        if score(row) == -math.inf:
            return "–"
        flagged = any((s := g.stats.get("eval.accuracy")) and s.flags for g in cells[row].values())
        return f"{score(row):.1f}" + (" ⚑" if flagged else "")

    rows = []
    for row in sorted(cells, key=lambda r: (-score(r), r)):
        texts = []
        for column in columns:
            g = cells[row].get(column)
            text = format_stat(accuracy, g.stats.get("eval.accuracy")) if g else "–"
            for key in headline if g else []:
                if key in g.stats:
                    text += f"; {metrics[key].label} {format_stat(metrics[key], g.stats[key])}"
            texts.append(text)
        rows.append([row, *texts, score_text(row)])
    return Section("Strategy leaderboard", [
        "Final global test accuracy (%) and, where measured, each diagnostic's and the strategy's headline "
        "metrics, mean ± 95% CI over seeds; rows sorted by the mean accuracy over columns (⚑: a value behind "
        "it is flagged).",
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
                   unmatched: list[PaperValue], paper: PaperValues | None, headline: list[tuple[Path, str]],
                   images: list[tuple[Path, str]], paths: list[Path], not_imported: list[str],
                   verdict_lines: list[str]) -> tuple[str, list[Section]]:
    """The report's title and sections, shared by the HTML page and the Markdown file: the
    claim's figure and the verdict first, then the protocol it was measured at, the groups,
    the runs that did not complete (first where none did: a failed or interrupted run's
    page says so at its top), the tables."""
    axes = list(dict.fromkeys(a for g in groups for a in g.axes))
    runs = [r for g in groups for r in g.runs]
    done = sum(r.status == "completed" for r in runs)
    if manifest:
        title = f"fedmech report: sweep {manifest.get('name')}, preset {manifest.get('preset') or 'none'}"
        title += f" ({len(runs) - done} of {len(runs)} runs not completed)" if done < len(runs) else ""
    elif len(runs) == 1:
        title = f"fedmech run {runs[0].name}: {runs[0].status}"
    else:
        title = "fedmech report"
    varying = differing_keys([g.config for g in groups])
    intro = [f"{len(groups)} groups, {len(runs)} runs, {done} completed. Each number is the mean ± 95% confidence "
             "interval (Student t over seeds) of the runs' values at their final round; n is the number of runs "
             "behind it (n=1: no interval). Only completed runs enter the statistics; the others are listed below. "
             "Accuracies are percent, gaps percentage points (pp); IoUs and R^2 are fractions. An undefined IoU "
             "(two empty circuits) never enters a mean: it is counted, with the empty circuits. A value its "
             "metric's validity rule flags is marked ⚑ with the number of seeds (e.g. one class: the model "
             f"predicts one class for more than {DEGENERATE_FRACTION:.0%} of the test images, so its accuracy is "
             "chance); it never satisfies a published bound."]
    left_out = [f"{r.name} (group {g.label}, seed {r.seed}): {r.status}" + (f": {r.error}" if r.error else "")
                for g in groups for r in g.runs if r.status != "completed"]
    not_in = Section("Runs not in the statistics", [left_out])
    sections = [not_in] if left_out and not done else []  # a failed or interrupted run's page says so first
    if not_imported:
        sections.append(Section("Plug-ins that could not be imported", [
            "These runs list plug-ins under `plugins:` that this Python environment cannot import, so the metrics "
            "those plug-ins declare are left out below: install them, or pass `--plugin MODULE`.", not_imported]))
    if headline or verdict_lines:
        sections.append(Section("Preserved or misaligned: the headline",
                                [*(Image(p, c) for p, c in headline), *verdict_lines[:1], *([verdict_lines[1:]] if verdict_lines else [])]))
    sections.append(_protocol_section(groups, paper, comparisons))
    sections.append(Section("Groups", [*intro, _groups_table(groups, axes)]))
    if left_out and done:
        sections.append(not_in)
    sections += _metric_tables(groups)
    if paper:
        sections.append(_paper_section(comparisons, unmatched, paper))
    if board := _leaderboard(groups, varying):
        sections.append(board)
    if images:
        sections.append(Section("Plots", ["Curves: mean over the completed runs of each group; the shaded band is "
                                          "the 95% CI (t) per round, or min–max where fewer than two runs; red "
                                          "rings mark rounds where a seed's value is flagged."]
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
            unmatched: list[PaperValue], paper: PaperValues | None, confidence: float) -> dict[str, Any]:
    """What the report says, for machines: no paths, no wall times."""
    def stat(s: Stat | None) -> dict[str, Any] | None:
        return None if s is None else {"mean": _finite(s.mean), "half_width": _finite(s.half_width), "n": s.n,
                                       "undefined": s.undefined, "empty": s.empty, "rounds": s.rounds,
                                       "flags": s.flags}

    def published(v: PaperValue) -> dict[str, Any]:
        return {"metric": v.metric, "value": v.value, "relation": v.relation, "where": v.where,
                "source": paper.cite(v), "quote": v.quote, "inferred": list(v.inferred)}

    return {
        "confidence": confidence,
        "interval": "Student t over seeds at each run's final round; completed runs only",
        "degenerate_fraction": DEGENERATE_FRACTION,
        "metrics": {k: {"label": m.label, "unit": m.unit, "record": m.record, "path": ".".join(m.path)}
                    for k, m in declared().items()},
        "sweep": None if manifest is None else {k: manifest.get(k) for k in ("name", "preset", "seeds", "axes")},
        "differing_keys": differing_keys([g.config for g in groups]),
        "groups": [{
            "group": g.label, "axes": g.axes, "runs": len(g.runs), "completed": len(g.completed),
            "partial": g.partial, "cells": [{"name": r.name, "seed": r.seed, "status": r.status} for r in g.runs],
            "stats": {k: stat(s) for k, s in g.stats.items()},
        } for g in groups],
        "paper": [{
            **published(c.paper), "group": c.group.label, "ours": stat(c.stat), "same_protocol": c.same_protocol,
            "check": c.check, "holds": c.result.holds if c.result else None,
            "result": c.result.text if c.result else None,
            "tested": None if c.shown is None else {"mean": _finite(c.shown[0]), "half_width": _finite(c.shown[1])},
            "difference": _finite(c.difference),
        } for c in comparisons] + [{**published(v), "group": None} for v in unmatched],
    }


def import_plugins(runs: list[Run], extra: list[str] = ()) -> list[str]:
    """Import the built-in and installed plug-ins, the ``extra`` modules (``--plugin``) and
    every run's recorded ``plugins:``, so that their declared metrics are read; for the
    runs whose plug-ins cannot be imported here, one line each saying why."""
    for module in extra:
        plugins.import_plugin(module, f"--plugin {module}")
    problems = {}
    for run in runs:
        try:
            load_plugins(run.config, str(run.path / CONFIG_FILE))
        except ConfigError as err:
            problems[run.name] = f"{run.name}: {err}"
    return list(problems.values())


def write_report(paths: list[str | Path], out_dir: str | Path, paper_file: str | Path | None = None,
                 confidence: float = 0.95, extra_plugins: list[str] = ()) -> Path:
    """Write index.html, report.md, plots/ and summary.json for a sweep folder or run
    folders into ``out_dir``; return the path of index.html."""
    paths = [Path(p).expanduser().resolve() for p in paths]
    out_dir = Path(out_dir).expanduser().resolve()
    manifest, runs = read_inputs(paths)
    if not runs:
        raise ConfigError(f"no runs to report on in {', '.join(map(str, paths))}", "fedmech report")
    not_imported = import_plugins(runs, extra_plugins)
    for problem in not_imported:
        log.warning("%s; its plug-ins' metrics are left out of the report", problem)
    groups = make_groups(manifest, runs)
    metrics = declared()
    for group in groups:
        group.stats = {k: s for k, m in metrics.items() if (s := group_stat(m, group.completed, confidence))}
    paper = read_paper_values(Path(paper_file), metrics) if paper_file else None
    comparisons, unmatched = compare(paper, groups) if paper else ([], [])
    plots = out_dir / PLOTS_DIR
    headline = plot_headline(groups, comparisons, plots, paper)
    images = plot_curves(groups, plots) + plot_per_class(groups, plots)
    verdict_lines = skew_verdict(groups)
    title, sections = build_sections(manifest, groups, comparisons, unmatched, paper, headline, images, paths,
                                     not_imported, [line.strip() for line in verdict_lines])
    write_text_atomic(out_dir / MARKDOWN_FILE, to_markdown(title, sections, out_dir))
    write_text_atomic(out_dir / SUMMARY_FILE, json.dumps(
        summary(manifest, groups, comparisons, unmatched, paper, confidence) | {"verdict": verdict_lines},
        indent=1, allow_nan=False) + "\n")
    index = write_text_atomic(out_dir / INDEX_FILE, to_html(title, sections))
    log.info("report of %d runs in %d groups written to %s", len(runs), len(groups), out_dir)
    return index
