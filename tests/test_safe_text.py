"""Known answers of ``fedmech_flwr.foundation.safe_text``: what the console, the report and the CSV
export make of text read from files."""

from __future__ import annotations

import pytest

from fedmech_flwr.foundation.safe_text import csv_cell, printable


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


def test_a_figures_text_is_made_printable_but_keeps_its_own_line_breaks(tmp_path):
    """A label's ESC is drawn as its escape; a legend entry wrapped on purpose stays on
    two lines (not a literal backslash-n)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedmech_flwr.foundation.files import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], label="published, at\nanother protocol")
    ax.set_title("class \x1b]0;x\x07")
    legend = ax.legend()
    save_figure(fig, tmp_path / "f.png")
    assert legend.get_texts()[0].get_text() == "published, at\nanother protocol"
    assert ax.get_title() == "class \\x1b]0;x\\x07"
    plt.close(fig)
