"""The report's groups and statistics: runs that differ only by seed form a group, and
each declared metric of a group is its runs' mean ± confidence interval at their final
rounds or at a given round (``group_stat``), with its undefined values counted and its
flags counted per flag; and how groups relate (a label-skewed group's IID control, a
dense control)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fedmech_flwr.artifacts.reader import FolderRun
from fedmech_flwr.contracts.outputs import ABSENT, Metric, latest, lookup
from fedmech_flwr.spec.config import differing_keys, flatten_plain
from fedmech_flwr.tools.report.stats import mean_ci


NOT_COMPARED = ("seed", "name", "output_root")
"""Config keys that do not make runs different experiments."""


AXIS_NAMES = {"data.dataset": "dataset", "data.partition": "label skew", "pruning.mode": "pruning",
              "pruning.target_sparsity": "sparsity target", "federation.num_rounds": "rounds",
              "federation.num_clients": "clients", "train.epochs": "local epochs", "train.lr": "learning rate"}
"""Readable names of config keys used as axes; others show their last component."""


def axis_name(key: str) -> str:
    """A sweep axis (``data.partition+pruning.mode``) as a column header (``label skew + pruning``)."""
    return " + ".join(AXIS_NAMES.get(part, part.rsplit(".", 1)[-1].replace("_", " ")) for part in key.split("+"))


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
    runs: list[FolderRun]
    stats: dict[str, Stat] = field(default_factory=dict)
    at_rounds: dict[int, dict[str, Stat]] = field(default_factory=dict)
    """The same statistics at the rounds the report was asked for (``--rounds``)."""

    @property
    def completed(self) -> list[FolderRun]:
        return [r for r in self.runs if r.status == "completed"]

    @property
    def partial(self) -> bool:
        return len(self.completed) < len(self.runs)

    @property
    def runs_text(self) -> str:
        done, total = len(self.completed), len(self.runs)
        return f"{done} of {total} completed" + (" (partial)" if 0 < done < total else "")


def plain_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


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
                axes[owner] = plain_text(f.get(owner))
            elif f"{owner}.name" not in f:
                axes[owner] = "none"
            else:
                params = [f"{k[len(owner) + 1:]}={plain_text(f[k])}" for k in owned if k != f"{owner}.name" and k in f]
                axes[owner] = f[f"{owner}.name"] + (f"({', '.join(params)})" if params else "")
        out.append(axes)
    return out


def make_groups(manifest: dict[str, Any] | None, runs: list[FolderRun]) -> list[Group]:
    """Runs that differ only by seed, as groups: the sweep's groups (in its order, named
    and labelled by its manifest), else by config, named by the keys that differ."""
    by_key: dict[str, list[FolderRun]] = {}
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


def group_stat(metric: Metric, runs: list[FolderRun], confidence: float = 0.95,
               at_round: int | None = None) -> Stat | None:
    """``metric`` at each run's last record holding it (or at round ``at_round``), over the
    runs; None when no run measured it. Undefined values are counted, never averaged;
    flagged values are averaged and counted per flag, so that every place showing the
    mean can say so."""
    values, undefined, empty, rounds, flags = {}, 0, 0, set(), defaultdict(int)
    measured = False
    for run in runs:
        if (found := latest(metric, run.records, at_round)) is None:
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


def number_text(metric: Metric, value: float, signed: bool = False) -> str:
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
        runs = f"{stat.undefined} run{'s' if stat.undefined != 1 else ''}"
        text = f"undefined ({stat.empty} empty)" if stat.empty else f"undefined in {runs}"
        return text + (f" ⚑ {stat.flag_text}" if stat.flag_text else "")
    unit = " pp" if metric.unit == "pp" else ""
    text = number_text(metric, stat.mean, signed=metric.unit == "pp")
    text += f" ± {number_text(metric, stat.half_width)}{unit} (n={stat.n})" if stat.half_width is not None \
        else f"{unit} (n=1, no interval)"
    text += (f", {stat.undefined} undefined" if stat.undefined else "") + empty
    return text + (f" ⚑ {stat.flag_text}" if stat.flag_text else "")


def control_of(group: Group, than: dict[str, Any], groups: list[Group]) -> Group | None:
    """The group that differs from ``group`` only under the parents of ``than``'s keys and
    has ``than``'s values there (the IID control of an alpha 0.05 group)."""
    parents = tuple(key.rsplit(".", 1)[0] + "." for key in than)

    def rest(config: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in flatten_plain(config).items() if not k.startswith(parents)}

    own = rest(group.config)
    return next((g for g in groups if g is not group and rest(g.config) == own
                 and all(flatten_plain(g.config).get(k, ABSENT) == v for k, v in than.items())), None)


def skew_level(config: dict[str, Any]) -> tuple[tuple, str]:
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


def is_dense_control(config: dict[str, Any]) -> bool:
    """A dense control: the same run without pruning."""
    return flatten_plain(config).get("pruning.mode") == "dense"
