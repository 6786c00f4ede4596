"""``fedmech export SWEEP_DIR | RUN_DIR ... --out FILE.csv``: every declared metric as one
tidy (long) table, for ``pandas.read_csv`` and a groupby.

One row per run x round x metric, and one more per class where the metric declares
per-class values (``class`` empty on the overall row). Declared metrics are exported
(``fedmech_flwr.contracts.outputs``), so a plug-in's metrics come out with no edit here, and so are
those a plug-in records without declaring them (``outputs.undeclared``: labelled by their
key, no unit, as recorded). Values are
as a reader reads them (``Metric.display``: percent and percentage points for ``%`` and
``pp``); an undefined value (null, NaN, a zero denominator) is an empty cell, never 0; a
value its metric's validity rule flags carries the flag's text. Every run with records is
exported whatever its status (the ``status`` column tells them apart). Values are numbers
in the file; a text cell that a spreadsheet would run as a formula (a folder's name, a
class name from a dataset file: ``=HYPERLINK(...)``) is written with a leading ``'``
(``safe_text.csv_cell``).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.reader import FolderRun, read_inputs, recorded_outputs
from fedmech_flwr.contracts.outputs import Metric, declared, latest, per_class_values
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.files import write_atomic
from fedmech_flwr.foundation.safe_text import csv_cell

COLUMNS = ["seed", "status", "round", "record", "metric", "label", "unit", "class", "value", "flag"]
"""The columns after ``run``, ``sweep`` and the sweep's axes."""


def check_out(path: Path) -> None:
    """Refuse an output the export cannot write, before any run is read."""
    if path.suffix.lower() != ".csv":
        why = "Parquet is not supported (fedmech does not depend on pyarrow)" if path.suffix.lower() == ".parquet" \
            else "fedmech export writes CSV"
        raise ConfigError(f"--out {path}: {why}; name a .csv file, e.g. --out {path.with_suffix('.csv')}")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {path}: {path.parent} is not a folder; make it first, or write the CSV elsewhere")


def _number(value: float | None, metric: Metric) -> float | str:
    """A value as a reader reads it, to 12 significant digits (no float noise such as
    30.000000000000004); empty when undefined."""
    return float(f"{metric.display(value):.12g}") if value is not None and math.isfinite(value) else ""


def run_rows(run: FolderRun, head: dict[str, Any], metrics: dict[str, Metric]) -> list[dict[str, Any]]:
    """The rows of one run, ordered by round, then the declared order of the metrics;
    ``head`` holds the run's ``run``, ``sweep`` and axis columns."""
    rows, names = [], run.class_names or []
    measured = sorted(((record, key) for key, metric in metrics.items()
                       for record in run.records_of(metric.record)), key=lambda pair: pair[0]["round"])
    for record, key in measured:
        metric = metrics[key]
        if (found := latest(metric, [record])) is None:  # this record does not hold it
            continue
        _, value, flag = found
        row = {**head, "seed": run.seed, "status": run.status, "round": record["round"], "record": metric.record,
               "metric": key, "label": metric.label, "unit": metric.unit, "class": "",
               "value": _number(value, metric), "flag": flag or ""}
        rows.append(row)
        for index, class_value in enumerate(per_class_values(metric, record) or []):
            rows.append({**row, "class": names[index] if index < len(names) else index,
                         "value": _number(class_value, metric)})
    return rows


def export_rows(paths: list[Path], extra_plugins: list[str] = ()) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    """The columns and rows of a sweep folder or run folders, as their runs recorded their
    declarations (no module a folder names is imported: ``artifacts.reader.recorded_outputs``),
    with one line per run from before runs recorded them (its plug-ins' metrics exported
    by key), and one per run with records that did not complete (what its ``status``
    column says, and why)."""
    manifest, runs = read_inputs([Path(p).expanduser().resolve() for p in paths])
    with recorded_outputs(runs, extra_plugins) as undeclared_runs:
        metrics = declared([record for run in runs for record in run.records])  # what plug-ins left undeclared too
    problems = [f"Exported by key: {line}" for line in undeclared_runs]
    problems += [f"Exported, but {run.name} is {run.status}" + (f": {run.note}" if run.note else "")
                 for run in runs if run.records and run.status != "completed"]
    axes = list(manifest.get("axes") or dict.fromkeys(a for r in runs for a in r.axes)) if manifest else []
    rows = []
    for run in runs:
        head = {"run": run.name, "sweep": manifest.get("name", "") if manifest else "",
                **{axis: run.axes.get(axis, "") for axis in axes}}
        rows += run_rows(run, head, metrics)
    return ["run", "sweep", *axes, *COLUMNS], rows, problems


def write_csv(columns: list[str], rows: list[dict[str, Any]], path: Path) -> Path:
    """Write the table atomically (a reader never sees half a file), no text cell a formula."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, columns)
            writer.writerow({column: csv_cell(column) for column in columns})
            writer.writerows({key: csv_cell(value) for key, value in row.items()} for row in rows)
    return write_atomic(path, write)
