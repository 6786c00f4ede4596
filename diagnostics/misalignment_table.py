"""``fedmech misalignment-table RUN_DIR ...``: the paper's table from run folders.

One row per run (its partition, strategy with its weighting, and client), read from the
``misalignment`` records of its metrics.jsonl at the last round (or ``--round N``): every
metric the diagnostic declares (its registered ``outputs``): the test accuracy of the global model, the
linear probe, the realigned heads and the data-free heads in percent, and the two gaps in
percentage points (the records hold fractions). A value its validity rule flags (a head
that predicts one class for more than ``DEGENERATE_FRACTION`` of the test images, or a gap
that rests on one) carries the flag: ``10.0 ⚑ one class``.

When an IID run is among the runs, every run with the same settings otherwise (the config
equal but for ``name``, ``output_root`` and ``data.partition``) also gets its
skew-attributable gaps: each gap minus the IID run's gap at the same round, since a probe
beats the global model under IID as well. Markdown, so it pastes into notes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api._builtin import CONFIG_FILE, DEGENERATE_FRACTION, lookup, read_records, read_yaml_file
from fedmech_flwr.api.command import COMMANDS, Command, Help
from fedmech_flwr.api.diagnostic import DIAGNOSTICS

GAPS = ("probe", "realigned")
FLAG_NOTE = (f"⚑ one class: the head (or, after a gap, a head behind it) predicts one class for more than "
             f"{100 * DEGENERATE_FRACTION:.0f}% of the test images; its accuracy is not a measurement of what it learned")


def _describe(component: dict[str, Any]) -> str:
    params = ", ".join(f"{k}={v}" for k, v in component.items() if k != "name" and not isinstance(v, (dict, list)))
    return f"{component['name']}({params})" if params else component["name"]


def read_record(run: Path, server_round: int | None) -> dict[str, Any]:
    """The run's misalignment record of ``server_round`` (default: its last one)."""
    records = [r for r in read_records(run, "diagnostic") if r["name"] == "misalignment"]
    if not records:
        raise ConfigError(f"{run} has no misalignment records; run it with the misalignment diagnostic")
    if server_round is None:
        return records[-1]
    for record in records:
        if record["round"] == server_round:
            return record
    rounds = [r["round"] for r in records]
    span = f"{rounds[0]} to {rounds[-1]}" if rounds == list(range(rounds[0], rounds[-1] + 1)) else str(rounds)
    raise ConfigError(f"{run} has no misalignment record at round {server_round}: it has them for rounds {span}")


def skew_gaps(record: dict[str, Any], iid_record: dict[str, Any]) -> dict[str, float]:
    """Each gap of ``record`` minus the same gap of the IID run's record (fractions): the part
    of the gap that label skew, not the probe's or the head's own advantage, accounts for."""
    return {key: record["gaps"][key] - iid_record["gaps"][key] for key in GAPS}


def table_row(run: Path, cfg: dict[str, Any], record: dict[str, Any]) -> dict[str, str]:
    """One row: the run's settings, then every declared metric, each flagged value marked."""
    row = {
        "run": run.name,
        "partition": _describe(cfg["data"]["partition"]),
        "strategy": _describe(cfg["strategy"]),
        "client": cfg["client"]["name"],
        "round": str(record["round"]),
    }
    for metric in DIAGNOSTICS.get("misalignment").outputs.metrics.values():  # the diagnostic's, by its name
        value = lookup(record, metric.path)
        cell = f"{metric.display(value):{'+' if metric.unit == 'pp' else ''}.1f}" if isinstance(value, float) else "-"
        if isinstance(value, float) and metric.flag and (flag := metric.flag(record)):
            cell += f" ⚑ {flag}"
        row[f"{metric.label} ({metric.unit})"] = cell
    return row


def _settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config without what an IID baseline may differ in."""
    out = {k: v for k, v in cfg.items() if k not in ("name", "output_root")}
    out["data"] = {k: v for k, v in cfg["data"].items() if k != "partition"}
    return out


def table(runs: list[Path], server_round: int | None) -> tuple[list[dict[str, str]], list[str]]:
    """A ``table_row`` per run, with skew-attributable gap columns when an IID run is given,
    and the notes that explain the flags used."""
    configs = {run: read_yaml_file(run / CONFIG_FILE) for run in runs}
    records = {run: read_record(run, server_round) for run in runs}
    rows = [table_row(run, configs[run], records[run]) for run in runs]
    notes = [FLAG_NOTE] if any("⚑" in cell for row in rows for cell in row.values()) else []
    iid_runs = [run for run in runs if configs[run]["data"]["partition"]["name"] == "iid"]
    if not iid_runs:
        return rows, notes
    for run, row in zip(runs, rows):
        baseline = next((b for b in iid_runs if b != run and _settings(configs[b]) == _settings(configs[run])), None)
        iid_record = None
        if baseline is not None:
            iid_record = next((r for r in read_records(baseline, "diagnostic")
                               if r["name"] == "misalignment" and r["round"] == records[run]["round"]), None)
        skew = skew_gaps(records[run], iid_record) if iid_record else None
        row["IID baseline"] = baseline.name if skew else "-"
        for key in GAPS:
            row[f"{key} gap beyond IID (pp)"] = f"{100 * skew[key]:+.1f}" if skew else "-"
    notes.append("gap beyond IID: the gap minus the IID run's gap (same settings, same round): what label skew adds")
    return rows, notes


def markdown(rows: list[dict[str, str]], notes: Sequence[str] = ()) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines + ([""] + list(notes) if notes else []))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run folders with misalignment records; an IID run among them adds the gaps beyond IID")
    parser.add_argument("--round", type=int, default=None, help="this round instead of the last one")


def run(args: argparse.Namespace) -> int:
    print(markdown(*table(args.runs, args.round)))
    return 0


COMMANDS.register("misalignment-table")(Command(Help(
    "print the global / probe / realigned table of run folders",
    "Print, as Markdown, one row per run from its misalignment records at the last round (or --round N): every "
    "metric the diagnostic declares (the global model's, the probe's, the realigned and data-free heads' test "
    "accuracy, the probe and realigned gaps), each flagged value marked; with an IID run among them, each gap "
    "beyond the IID run's (what label skew adds).",
    ("0  printed", "2  a run without misalignment records, or without the round asked for"),
    ("fedmech misalignment-table ~/fedmech-runs/misalign-iid-* ~/fedmech-runs/misalign-a0.05-*",
     "fedmech misalignment-table RUN_DIR --round 10")), add_arguments, run))
