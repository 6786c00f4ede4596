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

A key is declared once, as the plug-in sends it: ``Outputs`` applies the records' key rule
(``record_key``: Flower's ``train-loss`` is recorded ``train_loss``) to its keys itself.

What a plug-in records without declaring it is not lost: ``undeclared(records)`` declares
it for the plug-in from the records' shape (each numeric top-level value of a diagnostic
that declares nothing, and of the strategy record each key no strategy declares and the
core did not put there, becomes a generic metric shown as recorded under the heading
``GENERIC_TITLE``), and ``declarations(records)`` adds those to the declared ones, so
``fedmech status``, the report, ``fedmech export`` and TensorBoard show them;
``notice`` says once, at the first round that records them, how to declare them.

A run records its declarations in its folder (``outputs_to_plain``, with each flagged
value's flag: ``recorded_flags``), so that whoever reads the folder later shows them
without importing a plug-in: inside ``reading(...)`` every function here answers from
those (``outputs_from_plain``) instead of the registries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

DEGENERATE_FRACTION = 0.9
"""A model or head that predicts one class for more than this share of the test images is a
degenerate (one-class) predictor: its accuracy hides that it no longer tells the classes
apart."""

ABSENT = object()
"""``lookup``'s answer when a record lacks a metric's first key (not measured there)."""

Flag = Callable[[dict[str, Any]], "str | None"]


def record_key(key: str) -> str:
    """A key as records write it: Python's snake_case. What clients and strategies send is
    keyed Flower's way (``train-loss`` in a MetricRecord) and renamed on the way in; a
    declaration names a key either way (``Outputs`` renames it)."""
    return key.replace("-", "_")


def _record_path(path: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """A path into a record, its first key (the record's own) as records write it."""
    return (record_key(path[0]), *path[1:]) if path else path


@dataclass(frozen=True)
class Metric:
    """One metric a plug-in records, declared once in its ``Outputs``: where it is in the
    record and how every view (console, report, CSV, TensorBoard) shows it.

    Parameters
    ----------
    label : str
        What it is, in words.
    path : tuple of str
        Keys into the record.
    unit : str
        ``%`` and ``pp`` (records hold fractions, shown x 100), ``IoU``, ``R^2`` or any other.
    decimals : int
        Places shown.
    better : {"higher", "lower"}, optional
        Which way is better, where one is.

    The other fields (``empty``, ``per``, ``per_class``, ``flag``) are documented where they
    are defined.

    Examples
    --------
    >>> Metric("L2 norm of the global model", ("global_norm",), "L2", 3)  # doctest: +ELLIPSIS
    Metric(label='L2 norm of the global model', ...)
    """

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
    def heading(self) -> str:
        """``label (unit)``; the label alone for a metric without a unit (an undeclared one)."""
        return f"{self.label} ({self.unit})" if self.unit else self.label

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
    """Short key -> metric; a key (and a path's first key) as the plug-in sends it or as
    records write it: either is stored as records write it (``record_key``)."""
    curves: tuple[str, ...] = ()
    """Metrics drawn per round (where measured at 3 rounds or more)."""
    headline: tuple[str, ...] = ()
    """The few a one-line summary shows: the sweep's progress line, the leaderboard's cells."""
    by_skew: tuple[str, ...] = ()
    """Metrics (accuracies) drawn against the label-skew level, the report's first figure:
    the model's own first, then readouts of its features (a probe, a retrained head), each
    of which the sweep's verdict sets beside its IID control and reads."""

    def __post_init__(self) -> None:
        """Apply the records' key rule (``record_key``) to every key and path, so that a
        plug-in names each key once, as it sends it."""
        metrics = {record_key(k): replace(m, path=_record_path(m.path), empty=_record_path(m.empty),
                                          per=_record_path(m.per), per_class=_record_path(m.per_class))
                   for k, m in self.metrics.items()}
        object.__setattr__(self, "metrics", metrics)
        for name in ("curves", "headline", "by_skew"):
            object.__setattr__(self, name, tuple(record_key(k) for k in getattr(self, name)))
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


def latest(metric: Metric, records: list[dict[str, Any]],
           at_round: int | None = None) -> tuple[dict[str, Any], Any, str | None] | None:
    """``(record, value, flag)`` of a declared ``metric`` (``record`` filled in) at the last
    of ``records`` that hold it, or at round ``at_round``: value None when undefined (null,
    NaN, a zero denominator); None when none measured it (there)."""
    mine = [r for r in records_of(records, metric.record) if at_round is None or r["round"] == at_round]
    if not mine:
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
    records = list(records)
    metrics = declared(records)
    parts = []
    for record, outputs in declarations(records).items():
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


def under_powered(*probes: tuple[str, ...]) -> Flag:
    """Flag a value that rests on an under-powered probe: any of ``probes`` (paths to probe
    records) says ``under_powered`` (its last doubling of training data still gained, so it
    measures its data as much as the features)."""
    def rule(record: dict[str, Any]) -> str | None:
        found = []
        for path in probes:
            value: Any = record
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            found.append(isinstance(value, dict) and value.get("under_powered") is True)
        return "under-powered" if any(found) else None
    return rule


def either(*rules: Flag) -> Flag:
    """A validity rule that raises every flag of ``rules``, joined: ``one class; under-powered``."""
    def rule(record: dict[str, Any]) -> str | None:
        return "; ".join(flag for r in rules if (flag := r(record))) or None
    return rule


EVAL = Outputs("Global model", {
    "accuracy": Metric("global test accuracy", ("accuracy",), "%", better="higher", per_class=("per_class_accuracy",),
                       flag=one_class(())),
    "sparsity": Metric("actual sparsity", ("sparsity",), "%", 2),
}, curves=("accuracy",), headline=("accuracy",))
"""The global model's test, every round (the core's ``eval`` record)."""


def declared(records: Iterable[dict[str, Any]] = ()) -> dict[str, Metric]:
    """Every declared metric, keyed ``RECORD.KEY``, with its ``record`` filled in; built-ins
    and loaded plug-ins alike, and what ``records`` hold undeclared (``declarations``)."""
    return metrics_of(declarations(records))


def metrics_of(outputs: dict[str, Outputs]) -> dict[str, Metric]:
    """The metrics of declarations by record, keyed ``RECORD.KEY``, ``record`` filled in
    (an undeclared metric's is filled in already: its declarations are keyed apart)."""
    return {f"{metric.record or record}.{key}": replace(metric, record=metric.record or record)
            for record, declared in outputs.items() for key, metric in declared.metrics.items()}


def declarations(records: Iterable[dict[str, Any]] = ()) -> dict[str, Outputs]:
    """The declared outputs by record: ``eval``, each diagnostic that declares any, and
    ``strategy`` (the strategies' declarations merged: one run has one strategy); then,
    given the ``records`` a view shows, what they hold that no plug-in declares
    (``undeclared``), keyed ``RECORD (undeclared)``. The built-in and installed plug-ins
    are imported first, an experiment's own by whoever reads its runs
    (``artifacts.reader.import_plugins``)."""
    records = list(records)
    out = _declared_outputs()
    out.update(reruns(records, out))
    out.update({f"{record} (undeclared)": generic for record, generic in undeclared(records, out).items()})
    return out


RERUN = "@"
"""``NAME@LABEL``: the records of diagnostic NAME rerun on a run's saved rounds with other
settings (``fedmech diagnose ... --as LABEL``)."""


RERUN_FLAGS = "flags"
"""In a ``NAME@LABEL`` record: the flag of each of its flagged values by metric key, which
``fedmech diagnose`` computed with NAME's rules (``rerun_flags``)."""


def reruns(records: Iterable[dict[str, Any]], outputs: dict[str, Outputs]) -> dict[str, Outputs]:
    """The declarations of the ``NAME@LABEL`` records among ``records``: NAME's own, each
    label suffixed ``[LABEL]`` and each flag read from the record itself (``RERUN_FLAGS``),
    so that every view shows a rerun beside the original without running a rule."""
    out = {}
    for record in records:
        name = record.get("name")
        if record.get("kind") != "diagnostic" or not isinstance(name, str) or RERUN not in name or name in out:
            continue
        base, label = name.split(RERUN, 1)
        if original := outputs.get(base):
            out[name] = Outputs(f"{original.title}, rerun as {label} (fedmech diagnose)",
                                {k: replace(m, label=f"{m.label} [{label}]", record="",
                                            flag=_flag_in_record(k) if m.flag else None)
                                 for k, m in original.metrics.items()},
                                curves=original.curves, headline=original.headline)
    return out


def _flag_in_record(key: str) -> Flag:
    return lambda record: (record.get(RERUN_FLAGS) or {}).get(key)


def rerun_flags(outputs: Outputs, record: dict[str, Any]) -> dict[str, str]:
    """The flag of each flagged value of ``record`` by ``outputs``' rules, by metric key:
    what a ``NAME@LABEL`` record carries (``RERUN_FLAGS``)."""
    return {key: flag for key, metric in outputs.metrics.items()
            if metric.flag and lookup(record, metric.path) is not ABSENT and (flag := metric.flag(record))}


_READING: list[dict[str, Outputs]] = []
"""The declarations ``reading`` gives, innermost last; empty: the registries'."""


@contextmanager
def reading(outputs: dict[str, Outputs]) -> Iterator[None]:
    """Inside this block the declarations are ``outputs`` (what run folders recorded,
    ``outputs_from_plain``), not the registries': a reader of run folders shows what
    their plug-ins declared without importing one."""
    _READING.append(outputs)
    try:
        yield
    finally:
        _READING.pop()


def _declared_outputs() -> dict[str, Outputs]:
    """What the registered plug-ins declare (``declarations`` without the records), or
    inside ``reading`` what it was given."""
    if _READING:
        return dict(_READING[-1])
    from fedmech_flwr.contracts import plugins

    plugins.load()
    return registered_outputs()


def registered_outputs(built_in_only: bool = False) -> dict[str, Outputs]:
    """The declarations of the plug-ins registered in this process (``built_in_only``:
    of the built-in ones alone, what a reader of a folder that recorded none falls back
    on), imported by whoever called."""
    from fedmech_flwr.contracts.hooks import DIAGNOSTICS
    from fedmech_flwr.foundation.registry import BUILT_IN
    from fedmech_flwr.contracts.strategy import STRATEGIES

    def chosen(registry: Any) -> list[tuple[str, Any]]:
        entries = [(name, registry.get(name)) for name in registry.names()]
        return [(name, e) for name, e in entries if e.outputs and (e.source == BUILT_IN or not built_in_only)]

    out = {"eval": EVAL}
    out.update({name: entry.outputs for name, entry in chosen(DIAGNOSTICS)})
    strategies = [entry.outputs for _, entry in chosen(STRATEGIES)]
    if strategies:
        out["strategy"] = Outputs("Strategy metrics", {k: m for o in strategies for k, m in o.metrics.items()},
                                  curves=tuple(k for o in strategies for k in o.curves),
                                  headline=tuple(k for o in strategies for k in o.headline))
    return out


GENERIC_TITLE = "{record}: metrics it records without declaring them (as recorded)"
"""The heading under which a record's undeclared metrics are shown (``undeclared``)."""
CORE_STRATEGY_KEYS = ("aggregate_seconds", "sent_model_accuracy", "sent_model_loss")
"""What the core itself puts in every strategy record, besides the clients' metrics
averaged: the server's time to aggregate, and the sent model's accuracy and loss where a
strategy reports another model."""
RECORD_FIELDS = ("kind", "round", "name", "seconds")
"""Keys of a diagnostic or strategy record that the core writes (``seconds``: the
diagnostic's wall time)."""


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def undeclared(records: Iterable[dict[str, Any]], outputs: dict[str, Outputs] | None = None) -> dict[str, Outputs]:
    """Generic declarations, by record, for what plug-ins record without declaring it, read
    from the records' shape: each numeric top-level value of a diagnostic that declares
    no outputs, and of the strategy record each key that no strategy declares and the core
    did not put there (``CORE_STRATEGY_KEYS``, or a key of the same records' client
    records: the clients' metrics, averaged). Each becomes a metric labelled by its key,
    shown as recorded (no unit, 3 decimals), under ``GENERIC_TITLE``; no curves, no
    headline. ``outputs``: the declared ones (default ``declarations()``)."""
    records = list(records)
    if not records:
        return {}
    outputs = _declared_outputs() if outputs is None else outputs
    outputs = {**outputs, **reruns(records, outputs)}
    strategy = outputs.get("strategy")
    skip_strategy = {*RECORD_FIELDS, *CORE_STRATEGY_KEYS, *(strategy.metrics if strategy else ()),
                     *(k for r in records if r.get("kind") == "client" for k in r)}
    found: dict[str, dict[tuple[str, ...], None]] = {}
    for record in records:
        if record.get("kind") == "diagnostic" and isinstance(record.get("name"), str) \
                and record["name"] not in outputs:
            source, skip = record["name"], RECORD_FIELDS
        elif record.get("kind") == "strategy":
            source, skip = "strategy", skip_strategy
        else:
            continue
        for key, value in record.items():
            if key not in skip:
                found.setdefault(source, {}).update(dict.fromkeys(numeric_leaves(value, (key,))))
    return {source: Outputs(GENERIC_TITLE.format(record=source),
                            {".".join(path): Metric(".".join(path), path, "", 3, record=source) for path in paths})
            for source, paths in found.items() if paths}


def numeric_leaves(value: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The key paths of every number in ``value``, a number or a mapping of them however
    nested (per layer, per client): ``("per_layer", "conv1")``. Each is a metric of its
    own: one row of the CSV, one TensorBoard scalar."""
    if _numeric(value):
        return [path]
    if isinstance(value, dict):
        return [leaf for key, inner in value.items() for leaf in numeric_leaves(inner, (*path, str(key)))]
    return []


def unshown(records: Iterable[dict[str, Any]], outputs: dict[str, Outputs] | None = None) -> dict[str, list[str]]:
    """By diagnostic that declares outputs, the keys of its records holding numbers that no
    declared metric reads (none of their paths starts there): written to metrics.jsonl,
    shown nowhere else, which the run says once (``app.run``)."""
    outputs = _declared_outputs() if outputs is None else outputs
    out: dict[str, dict[str, None]] = {}
    for record in records:
        name = record.get("name")
        if record.get("kind") != "diagnostic" or name not in outputs:
            continue
        read = {metric.path[0] for metric in outputs[name].metrics.values()}
        for key, value in record.items():
            if key not in read and key not in RECORD_FIELDS and numeric_leaves(value, (key,)):
                out.setdefault(name, {})[key] = None
    return {name: list(keys) for name, keys in out.items()}


_PATHS = ("path", "empty", "per", "per_class")
"""A ``Metric``'s fields that hold key paths (tuples; lists in JSON)."""


def outputs_to_plain(outputs: dict[str, Outputs]) -> dict[str, Any]:
    """Declarations as JSON data, every field but the validity rules, whose results a run
    records per round instead (``recorded_flags``); ``flagged`` says a metric has one."""
    def metric(m: Metric) -> dict[str, Any]:
        plain = {f.name: getattr(m, f.name) for f in fields(Metric) if f.name != "flag"}
        return {**{k: list(v) if k in _PATHS and v is not None else v for k, v in plain.items()},
                "flagged": m.flag is not None}

    return {record: {"title": o.title, "metrics": {k: metric(m) for k, m in o.metrics.items()},
                     "curves": list(o.curves), "headline": list(o.headline), "by_skew": list(o.by_skew)}
            for record, o in outputs.items()}


def outputs_from_plain(doc: dict[str, Any], flag_of: Callable[[str, dict[str, Any]], str | None]) -> dict[str, Outputs]:
    """Declarations from ``outputs_to_plain`` data; a flagged metric's rule is
    ``flag_of(KEY, record)`` (``RECORD.KEY``), which answers from the flags a run recorded
    (``recorded_flags``): no plug-in's code runs. Fields a later version adds are dropped."""
    known = {f.name for f in fields(Metric)} - {"flag"}

    def metric(record: str, key: str, plain: dict[str, Any]) -> Metric:
        values = {k: tuple(v) if k in _PATHS and v is not None else v for k, v in plain.items() if k in known}
        name = f"{values.get('record') or record}.{key}"
        flag = (lambda r, name=name: flag_of(name, r)) if plain.get("flagged") else None
        return Metric(**values, flag=flag)

    return {record: Outputs(o["title"], {k: metric(record, k, m) for k, m in o["metrics"].items()},
                            tuple(o.get("curves", ())), tuple(o.get("headline", ())), tuple(o.get("by_skew", ())))
            for record, o in doc.items()}


def recorded_flags(outputs: dict[str, Outputs], records: Iterable[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each flagged value among ``records``: ``{"RECORD.KEY": {"ROUND": flag}}``, what a
    reader of the run folder shows where the metric's rule would run."""
    records = list(records)
    out: dict[str, dict[str, str]] = {}
    for key, metric in metrics_of(outputs).items():
        if metric.flag is None:
            continue
        for record in records_of(records, metric.record):
            if lookup(record, metric.path) is not ABSENT and (flag := metric.flag(record)):
                out.setdefault(key, {})[str(record["round"])] = flag
    return out


def notice(record: str, generic: Outputs, plugin: str) -> str:
    """The one line that says, at the first round a plug-in records metrics it does not
    declare, that they are shown as recorded and how to declare them (``plugin``: its
    registry and name, e.g. ``DIAGNOSTICS 'geometry'``)."""
    registry, _, name = plugin.partition(" ")
    keys = ", ".join(generic.metrics)
    return (f"{plugin} records metrics it does not declare ({keys}): they are shown as recorded under "
            f"'{generic.title}'; to give them labels, units and curves, register it with "
            f"{registry}.register({name}, ..., outputs=Outputs(...)) (fedmech_flwr.api)")
