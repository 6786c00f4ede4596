"""The catalogue of semantic mutants (benchmarks/semantic_mutants.py) stays true to the code:
every snippet is still in its module exactly once and its mutant compiles, every method
has its bugs, and the plug-in's import hook does apply a mutant. Running the catalogue
(each mutant against its tests, several minutes) is ``make mutation``'s job."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("semantic_mutants", REPO / "benchmarks" / "semantic_mutants.py")
semantic_mutants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("semantic_mutants", semantic_mutants)  # its dataclasses look their module up there
_spec.loader.exec_module(semantic_mutants)
MUTANTS = semantic_mutants.MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutants_snippet_is_in_its_module_once_and_its_mutant_compiles(mutant):
    path = Path(importlib.util.find_spec(mutant.module).origin)
    source = path.read_text()
    mutated = mutant.apply(source)  # raises unless the snippet is there exactly once
    assert mutated != source
    compile(mutated, str(path), "exec")
    for test in mutant.killed_by:
        file, _, name = test.partition("::")
        assert f"def {name.split('[')[0]}(" in (REPO / file).read_text(), test


def test_the_catalogue_covers_every_method_with_every_kind_of_bug():
    assert len(MUTANTS) >= 25
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    methods = {"scaffold", "fednova", "feddyn", "proximal", "moon", "fedrs", "fedlc", "fedrod", "etf", "fedetf",
               "fedbabu", "feddecorr", "fedopt"}
    assert methods <= {m.module.rsplit(".", 1)[-1] for m in MUTANTS}
    assert {m.kind for m in MUTANTS} >= {"wrong count", "wrong normaliser", "state at the wrong time", "sign",
                                         "detached or aliased tensor", "batch vs shard statistics"}


def test_a_mutant_that_breaks_its_snippet_says_so():
    mutant = semantic_mutants.Mutant("x", "m", "a = 1", "a = 2", "sign", "", ())
    assert mutant.apply("a = 1\n") == "a = 2\n"
    with pytest.raises(ValueError, match="expected its snippet once in m, found it 2 times; update the mutant"):
        mutant.apply("a = 1\na = 1\n")


def test_the_import_hook_loads_the_module_mutated(tmp_path, monkeypatch):
    (tmp_path / "rule_under_test.py").write_text("SIGN = 1\n")
    mutant = semantic_mutants.Mutant("flip", "rule_under_test", "SIGN = 1", "SIGN = -1", "sign", "", ())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [semantic_mutants.MutantFinder(mutant), *sys.meta_path])
    marker = tmp_path / "applied"
    monkeypatch.setenv(semantic_mutants.ENV_MARKER, str(marker))
    monkeypatch.delitem(sys.modules, "rule_under_test", raising=False)
    module = importlib.import_module("rule_under_test")
    assert module.SIGN == -1 and marker.exists()
    assert (tmp_path / "rule_under_test.py").read_text() == "SIGN = 1\n"  # the file is untouched
    monkeypatch.delitem(sys.modules, "rule_under_test")
