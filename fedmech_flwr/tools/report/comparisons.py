"""Published values (``fedmech_flwr.tools.published``) held against the groups that
measured their metric: a bound, or a direction against the group's interval."""

from __future__ import annotations

from dataclasses import dataclass

from fedmech_flwr.contracts.outputs import declared
from fedmech_flwr.tools.published import PaperValue, PaperValues, Verdict, verdict
from fedmech_flwr.tools.report.statistics import Group, Stat, control_of, number_text
from fedmech_flwr.tools.report.stats import difference_ci, mean_ci


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


def _flags(*stats: tuple[str, Stat | None]) -> str | None:
    """The flags of the values a check rests on, each named by whose it is."""
    return "; ".join(f"{who}{t}" for who, s in stats if s and (t := s.flag_text)) or None


def _judge(paper: PaperValue, group: Group, groups: list[Group], same: bool) -> Comparison:
    """The bound or the direction of ``paper`` held against ``group``'s interval."""
    metrics = declared()
    metric, stat = metrics[paper.metric], group.stats[paper.metric]
    out = Comparison(paper, group, same)
    if paper.relation in ("<", ">"):
        out.check = f"{paper.relation} {number_text(metric, paper.value)} (bound)"
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
        control = control_of(group, direction.than_group, groups)
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
