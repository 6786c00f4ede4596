"""``fedmech misalignment-table RUN_DIR ...``: the paper's table from run folders.

One row per run (its partition, strategy and client), read from the ``misalignment``
records of its metrics.jsonl at the last round (or ``--round N``): test accuracy of the
global model, the linear probe, the realigned head (validation- and test-selected), the
data-free heads, and the two gaps, in percent. Markdown, so it pastes into notes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from fedmech_flwr.commands import COMMANDS, Command
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.run_folder import CONFIG_FILE, read_records

COLUMNS = {
    "global": "global",
    "probe": "probe",
    "realigned": "realigned (val-selected)",
    "realigned_test_selected": "realigned (test-selected)",
    "tau_norm": "tau-norm",
    "ncm": "NCM (client stats)",
    "ccvr": "CCVR (client stats)",
}


def _describe(component: dict[str, Any]) -> str:
    params = ", ".join(f"{k}={v}" for k, v in component.items() if k != "name" and not isinstance(v, (dict, list)))
    return f"{component['name']}({params})" if params else component["name"]


def table_row(run: Path, server_round: int | None) -> dict[str, str]:
    records = [r for r in read_records(run, "diagnostic") if r["name"] == "misalignment"]
    if server_round is not None:
        records = [r for r in records if r["round"] == server_round]
    if not records:
        at = f" at round {server_round}" if server_round is not None else ""
        raise ConfigError(f"{run} has no misalignment records{at}; run it with the misalignment diagnostic")
    record = records[-1]
    cfg = yaml.safe_load((run / CONFIG_FILE).read_text())
    pct = lambda key: f"{100 * record[key]['accuracy']:.1f}" if key in record else "-"  # noqa: E731
    return {
        "run": run.name,
        "partition": _describe(cfg["data"]["partition"]),
        "strategy": cfg["strategy"]["name"],
        "client": cfg["client"]["name"],
        "round": str(record["round"]),
        **{label: pct(key) for key, label in COLUMNS.items()},
        "probe - global": f"{100 * record['gaps']['probe']:+.1f}",
        "realigned - global": f"{100 * record['gaps']['realigned']:+.1f}",
    }


def markdown(rows: list[dict[str, str]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, help="run folders with misalignment records")
    parser.add_argument("--round", type=int, default=None, help="this round instead of the last one")


def run(args: argparse.Namespace) -> int:
    print(markdown([table_row(path, args.round) for path in args.runs]))
    return 0


COMMANDS.register("misalignment-table")(Command("print the global / probe / realigned table of run folders",
                                                add_arguments, run))
