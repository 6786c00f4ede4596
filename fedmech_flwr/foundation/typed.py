"""Validate plain dicts (from YAML) into typed dataclasses, with errors that name the key.

Supported field types: bool, int, float, str, ``Literal[...]`` (choices), ``X | None``,
``list[X]``, ``dict[K, V]`` and nested dataclasses. Ranges live in field metadata
(``gt``, ``ge``, ``lt``, ``le``); every number must also be one a machine can hold: a
float finite (``.inf`` and ``.nan`` are typos, never settings), an integer within 64 bits
(``INT_LIMIT``), in a list or mapping too. A field whose metadata has ``parse`` (a callable taking
the raw value and its location) is parsed by it. Unknown keys are errors, never silently
dropped. A field's documentation is the string literal written after it (an attribute
docstring); ``describe_fields`` reads it back for ``fedmech list``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import textwrap
import types
import typing
from typing import Any, Literal, TypeVar, Union

from fedmech_flwr.foundation.errors import ConfigError, brief
from fedmech_flwr.foundation.registry import did_you_mean

T = TypeVar("T")

INT_LIMIT = 2**63 - 1
"""The largest integer a config may hold anywhere: torch and NumPy hold integers in 64
bits, so a larger one fails deep inside them instead of at its key."""

_RANGE_CHECKS = {
    "gt": (lambda v, b: v > b, ">"),
    "ge": (lambda v, b: v >= b, ">="),
    "lt": (lambda v, b: v < b, "<"),
    "le": (lambda v, b: v <= b, "<="),
}


def parse_dataclass(cls: type[T], data: Any, where: str) -> T:
    """Build ``cls`` from ``data`` (a mapping), validating every field.

    ``where`` is a location prefix for messages, e.g. ``"experiments/x.yaml: data"``.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {type(data).__name__} {brief(data)}", where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "(none)"
        hints = "".join(did_you_mean(key, fields) for key in unknown)
        raise ConfigError(f"unknown key(s) {unknown}; {hints}allowed keys: {allowed}", where)
    kwargs = {}
    for name, f in fields.items():
        key_where = join_key(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{name}'", key_where)
            continue
        parse = f.metadata.get("parse")
        value = parse(data[name], key_where) if parse else _coerce(hints[name], data[name], key_where)
        _check_range(f, value, key_where)
        kwargs[name] = value
    return cls(**kwargs)


def join_key(where: str, key: str) -> str:
    """``"x.yaml:"`` + ``data`` -> ``"x.yaml: data"``; ``"x.yaml: data"`` + ``seed`` -> ``"x.yaml: data.seed"``."""
    if not where:
        return key
    return f"{where} {key}" if where.endswith(":") else f"{where}.{key}"


def to_plain(obj: Any) -> Any:
    """Dataclasses, lists and dicts as plain Python (for YAML/JSON).

    Objects with their own ``to_plain()`` method (plug-in components) use it.
    """
    if hasattr(obj, "to_plain"):
        return obj.to_plain()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One config key as ``fedmech list`` shows it."""

    key: str
    """Dotted below its section, e.g. ``probe.lr`` for a nested dataclass."""
    type: str
    """What it accepts, with its range, e.g. ``float > 0`` or ``"ste" | "hard_concrete"``."""
    default: str | None
    """The default as JSON (which YAML reads back), ``required``, or None for a nested
    dataclass, whose keys follow it."""
    doc: str
    """The first sentence of its attribute docstring ("" if it has none)."""


def describe_fields(cls: type, defaults: Any = None, prefix: str = "") -> list[FieldInfo]:
    """The keys ``parse_dataclass(cls, ...)`` accepts, nested dataclasses expanded.

    ``defaults`` is the instance whose values are shown (a nested field's own default,
    which may differ from its class's defaults); None: the fields' defaults.
    """
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp, doc = f"{prefix}{f.name}", hints[f.name], _first_sentence(docs.get(f.name, ""))
        value = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        if dataclasses.is_dataclass(tp) and "parse" not in f.metadata:
            rows.append(FieldInfo(key, _type_name(tp), None, doc))
            rows += describe_fields(tp, None if value is dataclasses.MISSING else value, f"{key}.")
            continue
        default = "required" if value is dataclasses.MISSING else json.dumps(to_plain(value))
        rows.append(FieldInfo(key, _type_text(tp) + _range_text(f), default, doc))
    return rows


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring, read from the source of ``cls`` and its bases
    (a subclass's wins); classes without source (defined interactively) give none."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bet al)(?<!\bvs)\.\s")


def _first_sentence(text: str) -> str:
    end = _SENTENCE_END.search(text)
    return (text[: end.start() + 1] if end else text).replace("``", "`")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _type_text(tp: Any) -> str:
    """A field type as a YAML user reads it: ``int | null``, ``"adam" | "sgd"``, ``list[int]``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return _type_name(tp)


def _range_text(f: dataclasses.Field) -> str:
    """`` >= 0.0, < 1.0`` from a field's range metadata ("" without one)."""
    bounds = [f"{symbol} {f.metadata[key]}" for key, (_, symbol) in _RANGE_CHECKS.items() if key in f.metadata]
    return f" {', '.join(bounds)}" if bounds else ""


def _check_range(f: dataclasses.Field, value: Any, where: str) -> None:
    """One line naming the key, the value and the allowed range when ``value`` falls
    outside the field's bounds or is not a number a machine holds (``_unholdable``)."""
    bad = _unholdable(value)
    if isinstance(bad, float):  # NaN compares false with every bound: say what is wrong with it
        raise ConfigError(f"{f.name} must be a finite number{_range_text(f)}, got {brief(bad)}", where)
    for key, (ok, symbol) in _RANGE_CHECKS.items():
        if key in f.metadata and value is not None and not ok(value, f.metadata[key]):
            bound = f.metadata[key]
            allowed = _range_text(f).strip()
            also = f" (allowed: {allowed})" if allowed != f"{symbol} {bound}" else ""
            raise ConfigError(f"{f.name} must be {symbol} {bound}, got {brief(value)}{also}", where)
    if bad is not None:
        raise ConfigError(f"{f.name} must be an integer{_range_text(f)} that fits in 64 bits (magnitude <= "
                          f"{INT_LIMIT}), got {brief(bad)}", where)


def _unholdable(value: Any) -> Any:
    """The first infinite or NaN float, or integer beyond ``INT_LIMIT``, in ``value`` (a
    number, or a list or mapping of them); None if there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((bad for item in items if (bad := _unholdable(item)) is not None), None)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _json_key(tp: Any, key: Any) -> Any:
    """JSON object keys are strings: read ``"3"`` as ``3`` for an int-keyed mapping, so a
    resolved config survives its JSON round trip to the clients."""
    if tp is int and isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            pass
    return key


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, where)
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError("; ".join(errors), where)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"got {brief(value)}; choose one of {choices}", where)
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {brief(value)}", where)
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping, got {brief(value)}", where)
        return {
            _coerce(args[0], _json_key(args[0], k), join_key(where, str(k))): _coerce(args[1], v, join_key(where, str(k)))
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {brief(value)}", where)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {brief(value)}", where)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {brief(value)}", where)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {brief(value)}", where)
        return value
    raise TypeError(f"unsupported config field type {_type_name(tp)} at {where}")
