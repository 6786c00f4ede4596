"""Published values: the verdict rule on intervals (known answers), the values file's
errors, and every quote of experiments/paper/values.yaml found in the text it cites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fedmech_flwr.contracts.outputs import declared
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.tools.published import read_paper_values, verdict
from fedmech_flwr.tools.report.stats import difference_ci

VALUES = Path(__file__).parents[1] / "experiments" / "paper" / "values.yaml"
TEXTS = Path(__file__).parents[2] / "shared" / "paper"
TEXT_FILES = {"summary": "v2_summary.txt", "abstract": "v2_abstract_and_references.txt", "writeup": "v1_writeup.txt"}
"""Where this machine keeps each text of values.yaml (the product cites the paper, not these paths)."""


@pytest.mark.parametrize("relation, bound, mean, half, flags, expected", [
    (">", 0.0, 5.0, 2.0, None, (True, "holds")),                    # [3, 7] above 0
    (">", 0.0, -5.0, 2.0, None, (False, "does not hold")),          # [-7, -3] below 0
    (">", 0.0, 1.0, 2.0, None, (None, "not shown: the interval contains it")),
    ("<", 0.3, 0.1, 0.1, None, (True, "holds")),                    # [0.0, 0.2] below 0.3
    ("<", 0.3, 0.25, 0.1, None, (None, "not shown: the interval contains it")),  # the mean alone would pass
    ("<", 0.3, 0.5, 0.1, None, (False, "does not hold")),
    (">", 0.0, 5.0, None, None, (None, "not shown: one run, no interval")),
    (">", 0.0, None, None, None, (None, "not shown: undefined")),
    ("<", 0.3, 0.0, 0.0, "mostly empty circuits in 3/3 seeds", (None, "not shown: mostly empty circuits in 3/3 seeds")),
])
def test_a_bound_holds_only_for_the_whole_interval(relation, bound, mean, half, flags, expected):
    result = verdict(relation, bound, mean, half, flags)
    assert (result.holds, result.text) == expected


def test_welch_difference_known_answer():
    # a = [1, 2, 3], b = [4, 6]: diff -3; se^2 = 1/3 + 2/2; df = (4/3)^2 / ((1/3)^2/2 + 1) = 1.6842;
    # scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval() gives [-8.97700, 2.97700]
    diff, half = difference_ci([1, 2, 3], [4, 6])
    assert diff == pytest.approx(-3.0)
    assert half == pytest.approx(5.976997, rel=1e-6)
    assert difference_ci([1.0], [2.0, 3.0]) == (pytest.approx(-1.5), None)


def write(tmp_path: Path, **changes) -> Path:
    raw = {"paper": "arXiv 0000.00000", "texts": {"t": {"version": "v1", "kind": "a test text"}}, "values": [
        {"metric": "misalignment.probe", "value": 1, "relation": "=", "text": "t", "quote": "q"}]}
    raw["values"][0].update(changes)
    (path := tmp_path / "values.yaml").write_text(yaml.safe_dump(raw, allow_unicode=True))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"text": "other"}, r"unknown text 'other'; the file's texts are t in .*values\[0\]\.text"),
    ({"relation": ">", "direction": {"relation": ">", "than": 0}}, r"a bound \(< or >\) is its own direction"),
    ({"direction": {"relation": ">"}}, r"give exactly one of than"),
    ({"direction": {"relation": ">", "than_metric": "misalignment.prob"}}, r"unknown metric 'misalignment.prob'"),
    ({"source": {"file": "x"}}, r"unknown key\(s\) source; allowed: "),
    ({"inferred": "IID"}, r"inferred must be a list of sentences"),
])
def test_a_bad_values_file_names_the_entry_and_key(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        read_paper_values(write(tmp_path, **changes), declared())


def test_the_values_file_reads_and_names_no_path():
    paper = read_paper_values(VALUES, declared())
    assert paper.paper == "arXiv 2512.23043" and len(paper.values) == 14
    assert "shared/" not in VALUES.read_text().split("paper: ", 1)[1]  # sources are texts, not files
    assert all("machine-generated" in paper.texts[v.text].kind for v in paper.values if v.text == "summary")
    # "+10.2 points (from 43.1% to 53.3%)" is one measurement: one estimator, the validation-selected head
    assert {v.metric for v in paper.values if v.value in (53.3, 10.2)} == {"misalignment.realigned",
                                                                           "misalignment.gaps.realigned"}


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("’", "'")).strip()


@pytest.mark.skipif(not TEXTS.is_dir(), reason="the paper's texts are not beside the repository (../shared/paper)")
def test_every_quote_is_in_the_text_it_cites():
    """Each quote (its parts around "...", in order) is in its text; a protocol quote in a
    text of its version."""
    paper = read_paper_values(VALUES, declared())
    texts = {key: _normal((TEXTS / name).read_text()) for key, name in TEXT_FILES.items()}
    assert set(texts) == set(paper.texts)
    quotes = [(texts[v.text], v.quote) for v in paper.values]
    for version, entries in paper.protocols.items():
        versions = " ".join(texts[k] for k, t in paper.texts.items() if t.version == version)
        quotes += [(versions, e.quote) for e in entries if e.quote]
    for text, quote in quotes:
        at = 0
        for part in _normal(quote).split(" ... "):
            found = text.find(part, at)
            assert found >= 0, f"not in its text: {part!r}"
            at = found + len(part)
