"""typed.py: YAML dicts into dataclasses, each bad value named by its key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.typed import describe_fields, join_key, parse_dataclass, to_plain


@dataclass
class Inner:
    rate: float = field(default=0.1, metadata={"gt": 0, "le": 1})
    """Learning rate, e.g. 0.1. Ignored when frozen."""
    kind: Literal["adam", "sgd"] = "sgd"


@dataclass
class Outer:
    steps: int
    """How many steps."""
    inner: Inner = field(default_factory=Inner)
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    weights: dict[int, float] = field(default_factory=dict)
    note: str | None = None
    flag: bool = False


def parse(data: dict) -> Outer:
    return parse_dataclass(Outer, data, "x.yaml:")


def test_values_of_every_supported_type_are_parsed():
    cfg = parse({"steps": 3, "inner": {"rate": "1e-3", "kind": "adam"}, "sizes": [4],
                 "weights": {"3": 0.5}, "note": "n", "flag": True})
    assert cfg == Outer(3, Inner(0.001, "adam"), [4], {3: 0.5}, "n", True)
    assert parse({"steps": 1}) == Outer(1)  # defaults for everything not given


@pytest.mark.parametrize(("data", "message"), [
    ({}, "missing required key 'steps' in x.yaml: steps"),
    ({"steps": 1, "stepz": 2}, "unknown key(s) ['stepz']; did you mean 'steps'? allowed keys: flag, inner, note, sizes, steps, weights in x.yaml:"),
    ({"steps": 1.5}, "expected an integer, got 1.5 in x.yaml: steps"),
    ({"steps": True}, "expected an integer, got True in x.yaml: steps"),
    ({"steps": 1, "flag": 1}, "expected true or false, got 1 in x.yaml: flag"),
    ({"steps": 1, "inner": {"rate": 0}}, "rate must be > 0, got 0.0 (allowed: > 0, <= 1) in x.yaml: inner.rate"),
    ({"steps": 1, "inner": {"rate": 2}}, "rate must be <= 1, got 2.0 (allowed: > 0, <= 1) in x.yaml: inner.rate"),
    ({"steps": 1, "inner": {"kind": "adamw"}}, "got 'adamw'; choose one of 'adam', 'sgd' in x.yaml: inner.kind"),
    ({"steps": 1, "sizes": [1, "two"]}, "expected an integer, got 'two' in x.yaml: sizes[1]"),
    ({"steps": 1, "sizes": 3}, "expected a list, got 3 in x.yaml: sizes"),
    ({"steps": 1, "weights": {"a": 1.0}}, "expected an integer, got 'a' in x.yaml: weights.a"),
    ({"steps": 1, "note": 5}, "expected a string, got 5 in x.yaml: note"),
    ({"steps": 1, "inner": [1]}, "expected a mapping, got list [1] in x.yaml: inner"),
])
def test_a_bad_value_is_refused_naming_its_key(data, message):
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert str(err.value) == message


def test_join_key_writes_dotted_keys_after_the_file():
    assert join_key("x.yaml:", "data") == "x.yaml: data"
    assert join_key("x.yaml: data", "seed") == "x.yaml: data.seed"
    assert join_key("", "seed") == "seed"


def test_to_plain_round_trips_through_parse():
    cfg = Outer(2, Inner(0.5, "adam"), [3], {1: 2.0}, None, True)
    plain = to_plain(cfg)
    assert plain == {"steps": 2, "inner": {"rate": 0.5, "kind": "adam"}, "sizes": [3], "weights": {1: 2.0},
                     "note": None, "flag": True}
    assert parse(plain) == cfg


def test_describe_fields_lists_keys_types_defaults_and_first_sentences():
    rows = {row.key: row for row in describe_fields(Outer)}
    assert list(rows) == ["steps", "inner", "inner.rate", "inner.kind", "sizes", "weights", "note", "flag"]
    assert (rows["steps"].type, rows["steps"].default, rows["steps"].doc) == ("int", "required", "How many steps.")
    assert rows["inner"].default is None  # a section: its keys follow
    assert (rows["inner.rate"].type, rows["inner.rate"].default) == ("float > 0, <= 1", "0.1")
    assert rows["inner.rate"].doc == "Learning rate, e.g. 0.1."  # "e.g." does not end the sentence
    assert rows["inner.kind"].type == '"adam" | "sgd"'
    assert (rows["weights"].type, rows["note"].type, rows["note"].default) == ("dict[int, float]", "str | null", "null")
