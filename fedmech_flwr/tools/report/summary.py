"""What the report says in short: the verdict (a label-skewed group against its IID
control, a line per readout and a reading per readout, for someone new) and
``summary.json`` (the groups' statistics for machines)."""

from __future__ import annotations

import math
from typing import Any

from fedmech_flwr.contracts.outputs import DEGENERATE_FRACTION, Metric, declarations, declared
from fedmech_flwr.spec.config import differing_keys, flatten_plain
from fedmech_flwr.tools.published import PaperValue, PaperValues
from fedmech_flwr.tools.report.comparisons import Comparison
from fedmech_flwr.tools.report.statistics import Group, Stat, control_of, skew_level
from fedmech_flwr.tools.report.stats import difference_ci, mean_ci


IID = {"data.partition.name": "iid"}
"""Where a label-skewed group's control differs from it: the same runs on an IID split."""


def _skew_keys() -> list[str]:
    """The first declared ``by_skew`` metrics: the model's own accuracy, then readouts of
    the same model's features (the misalignment diagnostic's global, probe, realigned)."""
    return next(([f"{record}.{k}" for k in outputs.by_skew] for record, outputs in declarations().items()
                 if outputs.by_skew), [])


def skew_pairs(groups: list[Group]) -> list[tuple[Group, Group]]:
    """(label-skewed group, its IID control) pairs that both measured the model's own
    accuracy and a readout of its features (``_measured``), the most skewed first."""
    pairs = [(g, c) for g in groups
             if flatten_plain(g.config).get("data.partition.name") != "iid"
             and (c := control_of(g, IID, groups)) is not None and _measured(g, c)]
    return sorted(pairs, key=lambda pair: skew_level(pair[0].config)[0], reverse=True)


def _measured(*groups: Group) -> list[str]:
    """The ``by_skew`` keys every one of ``groups`` measured, the model's own accuracy first;
    empty unless that and at least one readout were (the pooled-data probe is optional)."""
    declared_keys = _skew_keys()
    keys = [k for k in declared_keys if all(k in g.stats for g in groups)]
    return keys if len(keys) > 1 and keys[0] == declared_keys[0] else []


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


CRITERION = "the Welch 95% interval of the skewed − IID difference excludes 0"
"""What the verdict calls a change: the difference of the two groups' means over seeds,
with its Welch interval (``stats.difference_ci``), clear of 0."""


def skew_verdict(groups: list[Group]) -> list[str]:
    """For someone new: the most skewed group's model accuracy and each readout of the same
    features (a probe, the realigned head) beside its IID control, one-class models said to
    be so, then one reading per readout (``_reading``); one seed is said to be one. A
    readout added to a diagnostic's ``by_skew`` gets its line and its reading. Empty
    without a skewed group and its control."""
    pairs = skew_pairs(groups)
    if not pairs:
        return []
    skewed, control = pairs[0]
    metrics, (model, *readouts) = declared(), _measured(skewed, control)
    n = min(s.n for g in (skewed, control) for k in (model, *readouts) if (s := g.stats[k]))
    seeds = ("one seed, so no interval (--seeds 0,1,2 gives intervals)" if n <= 1
             else f"{n} seeds each, mean ± 95% interval; a change is claimed only where {CRITERION}")
    more = f"; {len(pairs) - 1} more on the page" if len(pairs) > 1 else ""
    lines = [f"Label skew ({skew_level(skewed.config)[1]}) against its IID control, {seeds}{more}:"]
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
    lines.extend(_reading(skewed, control, model, readout, n) for readout in readouts)
    lines.append(_calibration(control, model, readouts))
    return lines


def _calibration(control: Group, model: str, readouts: list[str]) -> str:
    """The IID control as the readouts' calibration: there the model's head is itself a
    linear readout of the features, so a readout that sees what they carry reaches the
    model's own accuracy (its per-run gap's interval reaches 0 or lies above it); one that
    falls short under-reads the features, and its skewed gap is read against this control."""
    metrics, parts = declared(), []
    for readout in readouts:
        gaps = _gaps(control.stats, readout, model)
        if not gaps:
            parts.append(f"{metrics[readout].label} undefined")
            continue
        mean, half, _ = mean_ci(gaps)
        short = (mean + half < 0) if half is not None else mean < 0
        verdict = ("falls short of it: it under-reads the features, so read its skewed gap against this control"
                   if short else "reaches it")
        parts.append(f"{metrics[readout].label} {_points(gaps)}, {verdict}")
    return ("  calibration (the IID control, where a readout that sees what the features carry reaches the model's "
            f"own accuracy): {'; '.join(parts)}.")


Change = tuple[float, float | None]
"""Skewed minus IID of one quantity over the two groups' runs, and its Welch half-width
(None with one seed)."""


def _clear(change: Change) -> bool:
    """Whether a change's interval excludes 0 (``CRITERION``; never without an interval)."""
    diff, half = change
    return half is not None and abs(diff) > half


def _pp(change: Change, signed: bool = True) -> str:
    """``+16.8 ± 5.9 pp``; unsigned (``16.8 ± 5.9 pp``) after "cost", "raised", "by"."""
    diff, half = change
    return (f"{diff:+.1f}" if signed else f"{abs(diff):.1f}") + (f" ± {half:.1f}" if half is not None else "") + " pp"


def _effect(who: str, change: Change) -> str:
    """``cost the head 26.6 ± 6.2 pp`` (``raised`` for a gain)."""
    return f"{'cost' if change[0] <= 0 else 'raised'} {who} {_pp(change, signed=False)}"


def _costs(readout: Change, head: Change) -> str:
    """``skew cost it 9.8 ± 3.6 pp and the head 26.6 ± 6.2 pp``, a verb said once where
    both moved the same way."""
    second = _effect("the head", head)
    if second.split()[0] == _effect("it", readout).split()[0]:
        second = second.split(" ", 1)[1]
    return f"skew {_effect('it', readout)} and {second}"


def _reading(skewed: Group, control: Group, model: str, readout: str, n: int) -> str:
    """The one sentence the numbers support about one readout of the features: what skew
    cost it and the head (the model's own accuracy), and how the readout − model gap
    moved, each a change only where ``CRITERION`` holds. "The features kept what the head
    stopped reading" only where the gap widened and the readout did not fall; a readout
    is a lower bound on what the features carry, so its fall is said as its own."""
    metrics = declared()
    name = metrics[readout].label
    gaps = _gaps(skewed.stats, readout, model), _gaps(control.stats, readout, model)
    if not all(gaps):
        return f"  → {name}: no reading, a value is undefined (see the page)."
    head, read = (difference_ci(list(skewed.stats[k].values.values()), list(control.stats[k].values.values()))
                  for k in (model, readout))
    gap = difference_ci(*gaps)
    numbers = f"{name} − {metrics[model].label} {_points(gaps[0])} skewed vs {_points(gaps[1])} IID"
    moved = f"{'widened' if gap[0] > 0 else 'narrowed'} by {_pp(gap, signed=False)}"
    if n <= 1:
        return (f"  → {name}: in this one seed {_costs(read, head)}; {numbers}, {moved}; "
                "one seed is not evidence: rerun with --seeds 0,1,2.")
    fell = _clear(read) and read[0] < 0
    if not _clear(gap):
        also = f"; skew cost it {_pp(read, signed=False)}" if fell else ""
        return (f"  → {name}: no evidence at n={n} that skew cost the head more than it: {numbers}, "
                f"a change of {_pp(gap)} whose interval holds 0{also}.")
    if gap[0] < 0:
        return f"  → {name}: {_costs(read, head)}: it lost more than the head; {numbers}, {moved}."
    if fell:
        return (f"  → {name}: {_costs(read, head)}: the head lost more, but what it reads of the features fell too; "
                f"{numbers}, {moved}.")
    own = (f"raised it {_pp(read, signed=False)}" if _clear(read)
           else f"moved it {_pp(read)}, an interval that holds 0")
    return (f"  → {name}: the features kept what the head stopped reading: skew {_effect('the head', head)} and "
            f"{own}; {numbers}, {moved}.")


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def summary(manifest: dict[str, Any] | None, groups: list[Group], comparisons: list[Comparison],
            unmatched: list[PaperValue], paper: PaperValues | None, confidence: float,
            metrics: dict[str, Metric] | None = None) -> dict[str, Any]:
    """What the report says, for machines: no paths, no wall times. ``metrics``: the
    declared ones and those the runs' records hold undeclared (default: the declared)."""
    def stat(s: Stat | None) -> dict[str, Any] | None:
        return None if s is None else {"mean": _finite(s.mean), "half_width": _finite(s.half_width), "n": s.n,
                                       "undefined": s.undefined, "empty": s.empty, "rounds": s.rounds,
                                       "flags": s.flags}

    def published(v: PaperValue) -> dict[str, Any]:
        return {"metric": v.metric, "value": v.value, "relation": v.relation, "where": v.where,
                "source": paper.cite(v), "quote": v.quote, "inferred": list(v.inferred)}

    return {
        "confidence": confidence,
        "interval": "Student t over seeds at each run's final round (at_rounds: at that round); completed runs only",
        "degenerate_fraction": DEGENERATE_FRACTION,
        "metrics": {k: {"label": m.label, "unit": m.unit, "record": m.record, "path": ".".join(m.path)}
                    for k, m in (declared() if metrics is None else metrics).items()},
        "sweep": None if manifest is None else {k: manifest.get(k) for k in ("name", "preset", "seeds", "axes")},
        "differing_keys": differing_keys([g.config for g in groups]),
        "groups": [{
            "group": g.label, "axes": g.axes, "runs": len(g.runs), "completed": len(g.completed),
            "partial": g.partial, "cells": [{"name": r.name, "seed": r.seed, "status": r.status} for r in g.runs],
            "stats": {k: stat(s) for k, s in g.stats.items()},
            "at_rounds": {str(r): {k: stat(s) for k, s in stats.items()} for r, stats in g.at_rounds.items()},
        } for g in groups],
        "paper": [{
            **published(c.paper), "group": c.group.label, "ours": stat(c.stat), "same_protocol": c.same_protocol,
            "check": c.check, "holds": c.result.holds if c.result else None,
            "result": c.result.text if c.result else None,
            "tested": None if c.shown is None else {"mean": _finite(c.shown[0]), "half_width": _finite(c.shown[1])},
            "difference": _finite(c.difference),
        } for c in comparisons] + [{**published(v), "group": None} for v in unmatched],
    }
