"""Known answers of ``fedmech_flwr.safe_text``: what the console, the report and the CSV
export make of text read from files."""

from __future__ import annotations

import pytest

from fedmech_flwr.safe_text import csv_cell, printable


@pytest.mark.parametrize(("text", "shown"), [
    ("plain text, ünïcode ✓ and a \\ stay", "plain text, ünïcode ✓ and a \\ stay"),
    ("a\x1b]0;x\x07", "a\\x1b]0;x\\x07"),
    ("tab\tnew\nline\rend", "tab\\tnew\\nline\\rend"),
    ("\x00\x7f\x85\x9b", "\\x00\\x7f\\x85\\x9b"),
    ("abc\u202edef\u2066\u2069\u202a", "abc\\u202edef\\u2066\\u2069\\u202a"),
    ("undecodable \udcff byte", "undecodable \\udcff byte"),
])
def test_printable_writes_each_control_character_as_its_escape(text, shown):
    assert printable(text) == shown
    assert printable(text).isprintable()


@pytest.mark.parametrize(("value", "cell"), [
    ("=1+1", "'=1+1"), ("+1", "'+1"), ("-A1", "'-A1"), ("@SUM(A1)", "'@SUM(A1)"), ("\tx", "\\tx"), ("\rx", "\\rx"),
    ("a=b", "a=b"), ("", ""), (-1.5, -1.5), (3, 3), (None, None),
])
def test_csv_cell_quotes_a_formula_and_leaves_numbers_numbers(value, cell):
    """A tab or carriage return that would start a formula is written as its escape
    (``printable``), which no spreadsheet runs."""
    assert csv_cell(value) == cell
