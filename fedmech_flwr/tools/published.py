"""Published values (``fedmech report --paper FILE``): what a paper's public texts state,
and the rules by which a report holds its groups against them.

A values file names the paper, the texts its values were read from (what kind of text
each is: the abstract, a machine-generated summary, a popular write-up), the protocol
each version's texts state, and every value with its quote and the inferences made in
reading it (experiments/paper/values.yaml is the example). Two rules follow:

- A value is compared in points only with a group run at the paper's protocol: every
  protocol entry stated by the texts and equal to the group's config. Elsewhere it is
  compared in direction: its ``direction`` (a sign, the same group's other metric, or a
  control group) must hold for the whole 95% interval.
- A bound (``<``, ``>``) holds when the interval lies on its side, fails when it lies on
  the other, and is "not shown" when the interval contains the bound or a value behind it
  is flagged (a one-class model, mostly empty circuits, a USAE that did not fit).

Format::

    paper: arXiv 2512.23043
    texts:            # key: {version, kind}
      summary: {version: v2, kind: "a machine-generated public summary of the later version"}
    protocols:        # per version: {key, label, value (null: not stated), quote, inferred}
      v2:
        - {key: pruning.target_sparsity, label: sparsity target, value: 0.999, quote: "..."}
    values:
      - metric: misalignment.gaps.probe_pooled   # a key of the report's metrics
        value: 21.7                         # in the report's unit (%, pp, IoU)
        relation: "="                       # =, ≈, or a bound < >
        where: {data.partition.alpha: 0.05} # dotted config keys a group must have
        text: summary
        quote: "..."                        # the text's words (tests check they are in it)
        inferred: ["alpha 0.05: ..."]       # every reading the text does not state
        note: "..."                         # optional
        direction: {relation: ">", than: 0} # or than_metric: KEY, or than_group: {KEY: VALUE}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmech_flwr.foundation.errors import ConfigError, brief, shape
from fedmech_flwr.foundation.yaml_text import read_yaml_file
from fedmech_flwr.spec.config import flatten_plain

RELATIONS = ("=", "≈", "<", ">")
BOUNDS = ("<", ">")
_ABSENT = object()


@dataclass(frozen=True)
class Text:
    """A public text values were read from."""

    version: str
    kind: str
    """What it is, as a reader should weigh it (e.g. "a machine-generated public summary")."""


@dataclass(frozen=True)
class ProtocolEntry:
    key: str
    """Dotted config key (a diagnostic's as ``diagnostics.NAME.KEY``)."""
    label: str
    value: Any
    """None: the texts do not state it."""
    quote: str | None = None
    inferred: str | None = None


@dataclass(frozen=True)
class Direction:
    """What a value says beyond its level: ``relation`` against a number (``than``), the
    same group's other metric (``than_metric``, paired per run) or the same metric in the
    group that differs from this one only in ``than_group``'s keys."""

    relation: str
    than: float | None = None
    than_metric: str | None = None
    than_group: dict[str, Any] | None = None

    def describe(self, label_of) -> str:
        if self.than_metric:
            return f"{self.relation} {label_of(self.than_metric)} of the same runs"
        if self.than_group:
            return f"{self.relation} the same metric at " + ", ".join(f"{k}={v}" for k, v in self.than_group.items())
        return f"{self.relation} {self.than:g}"


@dataclass(frozen=True)
class PaperValue:
    metric: str
    value: float
    """In the report's unit for ``metric``."""
    relation: str
    where: dict[str, Any]
    """Dotted config keys a group must have these values of."""
    text: str
    """Key of the text it was read from."""
    quote: str
    inferred: tuple[str, ...] = ()
    """Every reading the text does not state (a skew, a dataset, a selection rule)."""
    note: str | None = None
    direction: Direction | None = None

    def matches(self, config: dict[str, Any]) -> bool:
        flat = flatten_plain(config)
        return all(flat.get(key, _ABSENT) == value for key, value in self.where.items())


@dataclass(frozen=True)
class PaperValues:
    paper: str
    """How the product cites it, e.g. "arXiv 2512.23043"."""
    texts: dict[str, Text]
    protocols: dict[str, list[ProtocolEntry]]
    """Per version, the protocol its texts state."""
    values: list[PaperValue]

    def cite(self, value: PaperValue) -> str:
        text = self.texts[value.text]
        return f"{self.paper} {text.version}, {text.kind}"

    def same_protocol(self, value: PaperValue, config: dict[str, Any]) -> bool:
        """Whether a group with ``config`` ran the protocol of ``value``'s version: every
        entry stated and equal (an unstated entry can never be shown to match)."""
        entries = self.protocols.get(self.texts[value.text].version, [])
        flat = flatten_plain(config)
        return bool(entries) and all(e.value is not None and flat.get(e.key, _ABSENT) == e.value for e in entries)


def _mapping(raw: Any, where: str, required: Iterable[str] | None, optional: Iterable[str] = ()) -> dict[str, Any]:
    """``raw`` as a mapping with the ``required`` keys and no others but ``optional``
    (``required`` None: any keys)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a mapping, got {brief(raw)}", where)
    if required is None:
        return raw
    required, allowed = set(required), set(required) | set(optional)
    if missing := required - set(raw):
        raise ConfigError(f"missing {', '.join(sorted(missing))}", where)
    if unknown := set(raw) - allowed:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}", where)
    return raw


def _number(raw: Any, where: str) -> float:
    if not isinstance(raw, (int, float)) or isinstance(raw, bool):
        raise ConfigError(f"expected a number in the report's unit, got {raw!r}", where)
    return float(raw)


def _direction(raw: Any, where: str, metrics: Iterable[str]) -> Direction:
    raw = _mapping(raw, where, ["relation"], ["than", "than_metric", "than_group"])
    if raw["relation"] not in BOUNDS:
        raise ConfigError(f"relation must be < or >, got {raw['relation']!r}", f"{where}.relation")
    given = [k for k in ("than", "than_metric", "than_group") if k in raw]
    if len(given) != 1:
        raise ConfigError("give exactly one of than (a number), than_metric (a metric key) or than_group "
                          "(the keys a control group differs in)", where)
    if "than" in raw:
        return Direction(raw["relation"], than=_number(raw["than"], f"{where}.than"))
    if "than_metric" in raw:
        if raw["than_metric"] not in metrics:
            raise ConfigError(f"unknown metric {raw['than_metric']!r}; use one of {', '.join(metrics)}",
                              f"{where}.than_metric")
        return Direction(raw["relation"], than_metric=raw["than_metric"])
    if not isinstance(raw["than_group"], dict) or not raw["than_group"]:
        raise ConfigError("than_group must map dotted config keys to the control group's values", f"{where}.than_group")
    return Direction(raw["relation"], than_group=raw["than_group"])


def read_paper_values(path: Path, metrics: Iterable[str]) -> PaperValues:
    """The values file at ``path``; ``metrics`` are the keys a value may name."""
    metrics = list(metrics)
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):  # the whole file: none of it quoted
        raise ConfigError(f"expected a mapping of paper:, texts:, values:, got {shape(raw)}", str(path))
    raw = _mapping(raw, str(path), ["paper", "texts", "values"], ["protocols"])
    texts = {}
    for key, item in _mapping(raw["texts"], f"{path}: texts", None).items():
        item = _mapping(item, f"{path}: texts.{key}", ["version", "kind"])
        texts[key] = Text(str(item["version"]), str(item["kind"]))
    protocols = {}
    for version, entries in _mapping(raw.get("protocols", {}), f"{path}: protocols", None).items():
        if not isinstance(entries, list):
            raise ConfigError("expected a list of {key, label, value}", f"{path}: protocols.{version}")
        protocols[str(version)] = [
            ProtocolEntry(**_mapping(e, f"{path}: protocols.{version}[{i}]", ["key", "label", "value"],
                                     ["quote", "inferred"]))
            for i, e in enumerate(entries)]
    if not isinstance(raw["values"], list):
        raise ConfigError("expected a list", f"{path}: values")
    values = []
    for i, item in enumerate(raw["values"]):
        where = f"{path}: values[{i}]"
        item = _mapping(item, where, ["metric", "value", "relation", "text", "quote"],
                        ["where", "inferred", "note", "direction"])
        if item["metric"] not in metrics:
            raise ConfigError(f"unknown metric {item['metric']!r}; use one of {', '.join(metrics)}", f"{where}.metric")
        if item["relation"] not in RELATIONS:
            raise ConfigError(f"relation must be one of {' '.join(RELATIONS)}, got {item['relation']!r}",
                              f"{where}.relation")
        if item["text"] not in texts:
            raise ConfigError(f"unknown text {item['text']!r}; the file's texts are {', '.join(texts)}", f"{where}.text")
        if not isinstance(item.get("where", {}), dict):
            raise ConfigError("where must map dotted config keys to values", f"{where}.where")
        inferred = item.get("inferred", [])
        if not isinstance(inferred, list) or not all(isinstance(s, str) for s in inferred):
            raise ConfigError("inferred must be a list of sentences", f"{where}.inferred")
        if item["relation"] in BOUNDS and "direction" in item:
            raise ConfigError("a bound (< or >) is its own direction; drop direction", f"{where}.direction")
        direction = _direction(item["direction"], f"{where}.direction", metrics) if "direction" in item else None
        values.append(PaperValue(item["metric"], _number(item["value"], f"{where}.value"), item["relation"],
                                 item.get("where", {}), item["text"], str(item["quote"]), tuple(inferred),
                                 item.get("note"), direction))
    return PaperValues(str(raw["paper"]), texts, protocols, values)


@dataclass(frozen=True)
class Verdict:
    holds: bool | None
    """None: not shown (the interval contains the bound, there is no interval, or a value
    behind it is flagged)."""
    text: str


def verdict(relation: str, bound: float, mean: float | None, half: float | None, flags: str | None) -> Verdict:
    """Whether the interval ``mean ± half`` lies on ``relation``'s side of ``bound``."""
    if flags:
        return Verdict(None, f"not shown: {flags}")
    if mean is None:
        return Verdict(None, "not shown: undefined")
    if half is None:
        return Verdict(None, "not shown: one run, no interval")
    low, high = mean - half, mean + half
    if (relation == ">" and low > bound) or (relation == "<" and high < bound):
        return Verdict(True, "holds")
    if (relation == ">" and high < bound) or (relation == "<" and low > bound):
        return Verdict(False, "does not hold")
    return Verdict(None, "not shown: the interval contains it")
