"""What a run records, declared by whoever records it.

Each metric has its key path in the record, a label, a unit (which fixes its scale), which
direction is better, where its per-class values are, and a validity rule (``flag``): when
its value must not be read as a measurement (a one-class predictor, ``one_class`` here; a
diagnostic's own, such as mostly empty circuits or a USAE that did not fit, in its
package). Every output that shows a metric (the console's round line, the run plots, the
sweep's progress line, ``fedmech status``, the report, ``fedmech export``, the TensorBoard
event files) reads these declarations, so a diagnostic or strategy a user writes shows up
there without a core edit.

The global model's ``eval`` record is declared here (``EVAL``); a diagnostic or a strategy
declares its records where it registers (``DIAGNOSTICS.register(name, Config,
outputs=Outputs(...))``); a strategy's metrics are the aggregate's MetricRecord, records of
kind ``strategy``. ``declared()`` collects them, keyed ``RECORD.KEY``
(``misalignment.global``, ``eval.accuracy``, ``strategy.krum_selected``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

DEGENERATE_FRACTION = 0.9
"""A model or head that predicts one class for more than this share of the test images is a
degenerate (one-class) predictor: its accuracy hides that it no longer tells the classes
apart."""

ABSENT = object()
"""``lookup``'s answer when a record lacks a metric's first key (not measured there)."""

Flag = Callable[[dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class Metric:
    label: str
    path: tuple[str, ...]
    """Keys into the record."""
    unit: str
    """``%`` and ``pp`` (records hold fractions, shown x 100), ``IoU``, ``R^2`` or any other
    (shown as recorded)."""
    decimals: int = 1
    better: Literal["higher", "lower"] | None = None
    empty: tuple[str, ...] | None = None
    """Keys to the count of empty circuits, shown next to an IoU."""
    per: tuple[str, ...] | None = None
    """Keys to a denominator: the value is ``path / per`` (e.g. shared concepts / dictionary size)."""
    per_class: tuple[str, ...] | None = None
    """Keys to the metric's per-class values (a list in class order, null where undefined);
    the report draws them per class for the accuracy and the headline metrics."""
    flag: Flag | None = None
    """The validity rule: a record's flag (e.g. "one class") when the value must not be read
    as a measurement; a flagged value is marked wherever shown and satisfies no bound."""
    doc: str = ""
    """What the value is, in words for someone new to the project (the verdict of a sweep
    with an IID control says it)."""
    record: str = ""
    """The record it is read from (``eval``, ``strategy`` or a diagnostic's name), which
    ``declared()`` fills in."""

    def display(self, value: float) -> float:
        return 100 * value if self.unit in ("%", "pp") else value

    @property
    def limits(self) -> tuple[float, float] | None:
        """The y range of a plot of this metric, where its unit fixes one."""
        return {"%": (0.0, 100.0), "IoU": (0.0, 1.05)}.get(self.unit)


@dataclass(frozen=True)
class Outputs:
    """The metrics one record holds, and where they are shown."""

    title: str
    """The heading of their table."""
    metrics: dict[str, Metric]
    """Short key -> metric."""
    curves: tuple[str, ...] = ()
    """Metrics drawn per round (where measured at 3 rounds or more)."""
    headline: tuple[str, ...] = ()
    """The few a one-line summary shows: the sweep's progress line, the leaderboard's cells."""
    by_skew: tuple[str, ...] = ()
    """Metrics (accuracies) drawn against the label-skew level, the report's first figure."""

    def __post_init__(self) -> None:
        unknown = [k for k in (*self.curves, *self.headline, *self.by_skew) if k not in self.metrics]
        if unknown:
            raise ValueError(f"outputs name metrics they do not declare: {', '.join(unknown)}")


def lookup(record: dict[str, Any], path: tuple[str, ...]) -> Any:
    """A record's value at ``path``: ``ABSENT`` when the record lacks the first key (not
    measured in that run); None when a deeper key is missing or the value is null or NaN."""
    if path[0] not in record:
        return ABSENT
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def per_class_values(metric: Metric, record: dict[str, Any]) -> list[float] | None:
    """A record's per-class values of ``metric`` (null as NaN); None where it has none."""
    value: Any = record
    for key in metric.per_class or ():
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if not metric.per_class or not isinstance(value, list):
        return None
    return [math.nan if v is None else float(v) for v in value]


def records_of(records: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The records a declaration's metrics are read from: of kind ``source`` (``eval``,
    ``strategy``), or a diagnostic's named ``source``."""
    return [r for r in records if r["kind"] == source or (r["kind"] == "diagnostic" and r.get("name") == source)]


def latest(metric: Metric, records: list[dict[str, Any]]) -> tuple[dict[str, Any], Any, str | None] | None:
    """``(record, value, flag)`` of a declared ``metric`` (``record`` filled in) at the last
    of ``records`` that hold it: value None when undefined (null, NaN, a zero denominator);
    None when none measured it."""
    if not (mine := records_of(records, metric.record)):
        return None
    last = max(mine, key=lambda r: r["round"])
    value = lookup(last, metric.path)
    if value is ABSENT:
        return None
    if value is not None and metric.per:
        per = lookup(last, metric.per)
        value = value / per if isinstance(per, float) and per else None
    return last, value, metric.flag(last) if metric.flag else None


def show(metric: Metric, value: float) -> str:
    """A recorded value as a reader reads it: ``27.8%``, ``+5.0 pp``, ``0.41``."""
    number = metric.display(value)
    if metric.unit == "%":
        return f"{number:.{metric.decimals}f}%"
    if metric.unit == "pp":
        return f"{number:+.{metric.decimals}f} pp"
    return f"{number:.{metric.decimals}f}"


def headline(records: list[dict[str, Any]]) -> list[str]:
    """The declared headline metrics of ``records`` at the last round that holds each (the
    global model's accuracy, then each diagnostic's and the strategy's), each with its
    flag: ``global test accuracy 10.0% ⚑ one class``, ``local-to-global undefined ⚑ mostly
    empty circuits``. What the console's round line and a sweep's progress line show."""
    metrics = declared()
    parts = []
    for record, outputs in declarations().items():
        for key in outputs.headline:
            metric = metrics[f"{record}.{key}"]
            if found := latest(metric, records):
                _, value, flag = found
                text = show(metric, value) if isinstance(value, float) else "undefined"
                parts.append(f"{metric.label} {text}" + (f" ⚑ {flag}" if flag else ""))
    return parts


def duration(seconds: float) -> str:
    """A wall time as a reader reads it: ``42s``, ``4m10s``, ``2h05m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def one_class(*heads: tuple[str, ...]) -> Flag:
    """Flag a value that rests on a one-class predictor: any of ``heads`` (paths to scores
    with ``max_predicted_fraction``) predicts one class for more than ``DEGENERATE_FRACTION``
    of the test images."""
    def rule(record: dict[str, Any]) -> str | None:
        fractions = [lookup(record, (*head, "max_predicted_fraction")) for head in heads]
        return "one class" if any(isinstance(f, float) and f > DEGENERATE_FRACTION for f in fractions) else None
    return rule


EVAL = Outputs("Global model", {
    "accuracy": Metric("global test accuracy", ("accuracy",), "%", better="higher", per_class=("per_class_accuracy",),
                       flag=one_class(())),
    "sparsity": Metric("actual sparsity", ("sparsity",), "%", 2),
}, curves=("accuracy",), headline=("accuracy",))
"""The global model's test, every round (the core's ``eval`` record)."""


def declared() -> dict[str, Metric]:
    """Every declared metric, keyed ``RECORD.KEY``, with its ``record`` filled in; built-ins
    and loaded plug-ins alike."""
    return {f"{record}.{key}": replace(metric, record=record) for record, outputs in declarations().items()
            for key, metric in outputs.metrics.items()}


def declarations() -> dict[str, Outputs]:
    """The declared outputs by record: ``eval``, each diagnostic that declares any, and
    ``strategy`` (the strategies' declarations merged: one run has one strategy); the
    built-in and installed plug-ins are imported first, an experiment's own by whoever
    reads its runs (``report.import_plugins``)."""
    from fedmech_flwr import plugins
    from fedmech_flwr.hooks import DIAGNOSTICS
    from fedmech_flwr.strategy import STRATEGIES

    plugins.load()
    out = {"eval": EVAL}
    out.update({name: entry.outputs for name in DIAGNOSTICS.names() if (entry := DIAGNOSTICS.get(name)).outputs})
    strategies = [entry.outputs for name in STRATEGIES.names() if (entry := STRATEGIES.get(name)).outputs]
    if strategies:
        out["strategy"] = Outputs("Strategy metrics", {k: m for o in strategies for k, m in o.metrics.items()},
                                  curves=tuple(k for o in strategies for k in o.curves),
                                  headline=tuple(k for o in strategies for k in o.headline))
    return out
