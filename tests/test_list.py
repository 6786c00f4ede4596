"""``fedmech list``: every registered entry with its config keys (type, range, default,
doc) and pairings; a bad kind exits 2 with a suggestion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from fedmech_flwr.foundation.typed import FieldInfo, describe_fields
from fedmech_flwr.spec.config import plugin_registries
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, EXIT_OK, LIST_KINDS, main


@pytest.fixture(autouse=True)
def terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # docs wrap the same on every terminal


def listed(capsys, *kind: str) -> str:
    assert main(["list", *kind]) == EXIT_OK
    out, err = capsys.readouterr()
    assert err == ""
    return out


def entry_titles(out: str) -> list[str]:
    """The entry names of a listing: its lines indented by exactly two spaces."""
    return [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line[2] != " "]


@pytest.mark.parametrize("plural", list(LIST_KINDS))
def test_each_kind_lists_every_registered_entry(capsys, plural):
    assert entry_titles(listed(capsys, plural)) == plugin_registries()[LIST_KINDS[plural]].names()


def test_without_kind_lists_every_kind(capsys):
    out = listed(capsys)
    for plural in LIST_KINDS:
        assert f"\n{plural.upper()}, " in f"\n{out}"
    assert len(entry_titles(out)) == sum(len(r.names()) for r in plugin_registries().values())


def test_singular_kind_lists_the_same(capsys):
    assert listed(capsys, "strategy") == listed(capsys, "strategies")


def test_entries_show_what_they_are_then_each_fields_type_range_default_and_doc(capsys):
    out = listed(capsys, "partitions")
    assert out.startswith("PARTITIONS, chosen by data.partition: {name: NAME, KEY: VALUE, ...}\n")
    assert ("  dirichlet  from fedmech_flwr.datasets.partition (built-in)\n"
            "    Label skew: for each class, draw client shares ~ Dir(alpha) and cut that class's shuffled\n"
            "    indices by them. Every sample goes to some client.\n"
            "    alpha: float > 0 = 0.5\n"
            "        Concentration: small (0.05) gives each client few classes, large (1e6) near-iid.\n"
            "    min_samples: int >= 0 = 10\n"
            "        Redraw until every client has at least this many samples.\n") in out
    assert "    classes: dict[int, list[int]] (required)\n" in out
    assert ("  iid  (no parameters)  from fedmech_flwr.datasets.partition (built-in)\n"
            "    Shuffle, then split into parts whose sizes differ by at most one.\n") in out


def test_pairings_are_shown_both_ways(capsys):
    assert ("  fedprox  (needs client 'proximal')  from fedmech_flwr.builtin.strategies.fedprox (built-in)\n"
            in listed(capsys, "strategies"))
    assert ("  proximal  (needs strategy 'fedprox')  (no parameters)  from fedmech_flwr.builtin.clients.proximal "
            "(built-in)\n" in listed(capsys, "clients"))


def test_nested_sections_show_the_defaults_of_their_field(capsys):
    out = listed(capsys, "diagnostics")
    assert "every: run after every N-th round, default 1" in out.splitlines()[0]
    title = "  misalignment  from fedmech_flwr.builtin.diagnostics.misalignment (built-in)\n"
    misalignment = out.split(title)[1].split("\n\n")[0]
    assert "    probe:\n        How the linear probe is trained" in misalignment
    assert "    probe.epochs: int >= 1 = 50\n" in misalignment  # the field's default, not LinearTrainConfig's
    assert "    head.epochs: int >= 1 = 5\n" in misalignment
    assert '    client_stats: list["ncm" | "ccvr"] = []\n' in misalignment


def test_inherited_fields_keep_their_docs(capsys):
    fedprox = listed(capsys, "strategies").split("  fedprox")[1].split("\n\n")[0]
    assert '    weighting: "examples" | "uniform" = "examples"\n        `examples` is canonical FedAvg' in fedprox
    assert "    proximal_mu: float >= 0.0 = 0.01\n        Weight mu of the proximal term; 0 is FedAvg." in fedprox


@pytest.mark.parametrize(("kind", "hint"), [("strategis", "did you mean 'strategies'? "), ("xyz", "")])
def test_unknown_kind_exits_2_naming_the_kinds(capsys, kind, hint):
    assert main(["list", kind]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"error: unknown kind '{kind}'; {hint}choose one of: datasets, partitions, models, clients, "
                   "strategies, diagnostics in fedmech list\n")


@dataclass
class Inner:
    steps: int = field(default=3, metadata={"ge": 1})
    """Optimisation steps. Only the first sentence is shown."""


@dataclass
class Outer:
    layer: str
    """A gated layer, e.g. conv2 (not the end of a sentence)."""
    inner: Inner = field(default_factory=lambda: Inner(steps=7))
    """How it is trained."""
    rate: float | None = field(default=None, metadata={"gt": 0.0, "lt": 1.0})
    mode: Literal["a", "b"] = "a"
    """``a`` or ``b``."""


def test_describe_fields_known_answer():
    assert describe_fields(Outer) == [
        FieldInfo("layer", "str", "required", "A gated layer, e.g. conv2 (not the end of a sentence)."),
        FieldInfo("inner", "Inner", None, "How it is trained."),
        FieldInfo("inner.steps", "int >= 1", "7", "Optimisation steps."),
        FieldInfo("rate", "float | null > 0.0, < 1.0", "null", ""),
        FieldInfo("mode", '"a" | "b"', '"a"', "`a` or `b`."),
    ]
