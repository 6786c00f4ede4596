"""The page's sections, shared by its HTML and its Markdown: the headline, the protocol
beside the paper's, the groups, each declared metric's table, the published values, the
strategy leaderboard, the plots and where every run came from."""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from fedmech_flwr.artifacts.folder import PLOTS_DIR
from fedmech_flwr.artifacts.plotting import DRAWN_FILE, skipped_plots
from fedmech_flwr.artifacts.reader import FolderRun
from fedmech_flwr.contracts.outputs import ABSENT, DEGENERATE_FRACTION, Metric, Outputs, declarations, declared, metrics_of
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.spec.config import differing_keys, flatten_plain
from fedmech_flwr.tools.published import PaperValue, PaperValues
from fedmech_flwr.tools.report.comparisons import Comparison
from fedmech_flwr.tools.report.render import Image, Section, Table
from fedmech_flwr.tools.report.statistics import (
    Group,
    axis_name,
    format_stat,
    is_dense_control,
    number_text,
    plain_text,
)


PROTOCOL = [("clients", "federation.num_clients"), ("rounds", "federation.num_rounds"),
            ("local epochs", "train.epochs"), ("samples per client round", "train.max_samples_per_round"),
            ("sparsity target", "pruning.target_sparsity")]
"""A group's protocol on the page: label and config key; the model, the actual sparsity and
the seeds follow, and the published values' protocols may add keys."""


NULL_SETTINGS = {"train.max_samples_per_round": "full shards"}
"""What a null protocol setting means, where it is not "none"."""


def _groups_table(groups: list[Group], axes: list[str]) -> Table:
    rows = [[g.label, *[g.axes.get(a, "–") for a in axes],
             ", ".join(str(r.seed) for r in g.runs), g.runs_text] for g in groups]
    return Table(["group", *map(axis_name, axes), "seeds", "runs"], rows)


def _setting(value: Any, key: str = "") -> str:
    """A protocol setting as a reader writes it (a plug-in: its name and parameters)."""
    if value is None:
        return NULL_SETTINGS.get(key, "none")
    if isinstance(value, dict) and "name" in value:
        params = [f"{k} {plain_text(v)}" for k, v in value.items() if k not in ("name", "stem")]
        return value["name"] + (f" ({', '.join(params)})" if params else "")
    return plain_text(value)


def _protocol_section(groups: list[Group], paper: PaperValues | None, comparisons: list[Comparison]) -> Section:
    """Each group's protocol, beside the published protocol of each version compared here."""
    compared = {paper.texts[c.paper.text].version for c in comparisons} if paper else set()
    protocols = {v: entries for v, entries in (paper.protocols.items() if paper else []) if v in compared}
    extra = [(e.label, e.key) for entries in protocols.values() for e in entries
             if e.key not in dict(PROTOCOL).values()]
    columns = list(dict.fromkeys(PROTOCOL + extra))
    header = ["", *[label for label, _ in columns], "model", "actual sparsity (%)", "seeds"]
    rows, notes, actual = [], [], declared()["eval.sparsity"]
    for version, entries in protocols.items():
        stated = {e.key: e for e in entries}
        cells = []
        for _, key in columns:
            e = stated.get(key)
            cells.append("–" if e is None else "not stated" if e.value is None else
                         _setting(e.value, key) + (" (inferred)" if e.inferred else ""))
            if e is not None and e.value is not None:
                notes.append(f"{paper.paper} {version}, {e.label} {_setting(e.value, key)}: “{e.quote}”"
                             + (f" — inferred {e.inferred}" if e.inferred else ""))
        rows.append([f"paper {version}", *cells, "–", "–", "–"])
    for g in groups:
        flat = flatten_plain(g.config)
        sparsity = g.stats.get("eval.sparsity")
        cells = [_setting(flat[key], key) if key in flat else "–" for _, key in columns]
        if is_dense_control(g.config) and "pruning.target_sparsity" in dict(columns).values():
            cells[[key for _, key in columns].index("pruning.target_sparsity")] = "dense"
        rows.append([g.label, *cells, _setting(g.config.get("model")),
                     format_stat(actual, sparsity), ", ".join(str(r.seed) for r in g.runs)])
    blocks: list[str | list[str] | Table | Image] = [Table(header, rows)]
    if protocols:
        blocks.insert(0, "What the paper's public texts state of its protocol (“not stated”: nothing in them), "
                         "then each group's. A published value is compared in points only with a group at the "
                         "paper's protocol (every entry stated and equal); elsewhere in direction only.")
        blocks.append(notes)
    return Section("Protocol", blocks)


def _metric_tables(groups: list[Group], outputs: dict[str, Outputs]) -> list[Section]:
    """One table per declaration (``outputs``: the declared ones and those the records
    hold undeclared, under their generic heading) of the metrics some group measured;
    with rounds asked for (``Group.at_rounds``), a row per group and round, then final."""
    sections = []
    rounds = sorted({r for g in groups for r in g.at_rounds})
    for name, declared_here in outputs.items():
        metrics = metrics_of({name: declared_here})
        keys = [k for k in metrics if any(k in g.stats for g in groups)]
        if not keys:
            continue
        if not rounds:
            header = ["group", "runs", *[metrics[k].heading for k in keys]]
            rows = [[g.label, g.runs_text, *[format_stat(metrics[k], g.stats.get(k)) for k in keys]] for g in groups]
            sections.append(Section(declared_here.title, [Table(header, rows)]))
            continue
        header = ["group", "runs", "round", *[metrics[k].heading for k in keys]]
        rows = [[g.label, g.runs_text, str(r) if r else "final",
                 *[format_stat(metrics[k], (g.at_rounds.get(r) if r else g.stats).get(k)) for k in keys]]
                for g in groups for r in (*rounds, None)]
        sections.append(Section(declared_here.title, [
            f"Each group at rounds {', '.join(map(str, rounds))} and at its runs' final round (–: not measured "
            "at that round).", Table(header, rows)]))
    return sections


def _result_text(c: Comparison, metric: Metric) -> str:
    """``holds: +5.1 ± 2.0 pp``: the verdict and the interval it rests on (``metric`` is
    the value's)."""
    if c.result is None:
        return "–"
    if c.shown is None:
        return c.result.text
    mean, half = c.shown
    difference = c.paper.relation not in ("<", ">") and c.paper.direction.than is None
    signed = difference or metric.unit == "pp"
    unit = " pp" if metric.unit == "pp" or (difference and metric.unit == "%") else ""
    interval = number_text(metric, mean, signed) + (f" ± {number_text(metric, half)}" if half is not None else "")
    interval += unit
    return f"{c.result.text} ({interval})"


def _paper_section(comparisons: list[Comparison], unmatched: list[PaperValue], paper: PaperValues) -> Section:
    shown = {id(c.paper) for c in comparisons} | {id(v) for v in unmatched}
    values = [v for v in paper.values if id(v) in shown]
    number = {id(v): i for i, v in enumerate(values, 1)}
    points = any(c.difference is not None for c in comparisons)
    metrics = declared()
    rows = []
    for c in comparisons:
        metric = metrics[c.paper.metric]
        row = [f"{metric.label} ({metric.unit})", c.group.label,
               f"{c.paper.relation} {number_text(metric, c.paper.value, metric.unit == 'pp')} [{number[id(c.paper)]}]",
               format_stat(metric, c.stat), c.check, _result_text(c, metric)]
        if points:
            row.append("–" if c.difference is None else number_text(metric, c.difference, True)
                       + (" pp" if metric.unit in ("%", "pp") else ""))
        rows.append(row)
    header = ["metric", "group", "paper", "ours (mean ± 95% CI)", "direction or bound checked", "result"]
    header += ["ours − paper (same protocol only)"] if points else []
    blocks: list[str | list[str] | Table | Image] = [] if not rows else [
        "A published value sits next to every group that measured its metric and whose config has all the values "
        "in its `where`. Where the group's protocol differs from the paper's (see Protocol), only the value's "
        "direction is checked, never a difference in points: it holds when the whole 95% interval lies on its "
        "side, does not hold when the whole interval lies on the other, and is not shown otherwise, or when a "
        "value behind it is flagged (⚑). A bound (< or >) is checked the same way.",
        Table(header, rows)]
    if unmatched:
        blocks.append("Not measured by any group here: " + "; ".join(
            f"{metrics[v.metric].label} {v.relation} {number_text(metrics[v.metric], v.value)} [{number[id(v)]}]"
            for v in unmatched) + ".")
    notes = []
    for v in values:
        inferred = f" Inferred: {'; '.join(v.inferred)}." if v.inferred else ""
        note = f" {v.note[0].upper()}{v.note[1:]}." if v.note else ""
        notes.append(f"[{number[id(v)]}] {paper.cite(v)}: “{v.quote}”.{inferred}{note}")
    return Section("Published values", [*blocks, notes])


def _strategy_defaults(name: Any, groups: list[Group]) -> dict[str, Any] | None:
    """A strategy's parameter defaults as flat config keys (``strategy.KEY``), as its runs
    recorded them, else as registered here (a built-in, for folders from before runs
    recorded them); None when neither knows (its row then names every parameter)."""
    from fedmech_flwr.contracts.strategy import STRATEGIES

    recorded = [run.outputs[2] for g in groups if g.config.get("strategy", {}).get("name") == name
                for run in g.runs if run.outputs and run.outputs[2] is not None]
    if recorded:
        return flatten_plain({"strategy": recorded[0]})
    try:
        return flatten_plain({"strategy": STRATEGIES.get(name).defaults})
    except (ConfigError, TypeError):
        return None


def _leaderboard(groups: list[Group], varying: list[str]) -> Section | None:
    """Strategy (name, weighting) + client x partition: final accuracy and probe gap."""
    if not any(k.startswith(("strategy.", "client.")) for k in varying):
        return None
    others = [k for k in varying if not k.startswith(("strategy.", "client.", "data.partition."))]
    cells: dict[str, dict[str, Group]] = defaultdict(dict)
    columns: list[str] = []
    by_strategy = defaultdict(list)
    for g in groups:
        by_strategy[g.config.get("strategy", {}).get("name")].append(g.config)
    # a strategy's row names the parameters that tell its own rows apart or differ from their defaults
    own_varying = {name: differing_keys(configs) for name, configs in by_strategy.items()}
    defaults = {name: _strategy_defaults(name, groups) for name in by_strategy}
    for g in groups:
        flat = flatten_plain(g.config)
        name = flat.get("strategy.name")
        shown = [k for k in flat if k.startswith("strategy.") and k not in ("strategy.name", "strategy.weighting")
                 and (k in own_varying[name] or defaults[name] is None or flat[k] != defaults[name].get(k, ABSENT))]
        params = [f"{k.split('.', 1)[1]}={plain_text(flat[k])}" for k in shown]
        weighting = [plain_text(flat["strategy.weighting"])] if "strategy.weighting" in flat else []
        label = ", ".join(weighting + params)
        row = f"{name}{f'({label})' if label else ''} + {flat.get('client.name')}"
        row += "".join(f", {k}={plain_text(flat.get(k))}" for k in others)
        partition = [f"{p}={plain_text(flat[key])}" for p in ("alpha", "k") if (key := f"data.partition.{p}") in flat]
        column = str(flat.get("data.partition.name")) + (f"({', '.join(partition)})" if partition else "")
        columns += [column] if column not in columns else []
        cells[row][column] = g
    metrics = declared()
    accuracy = metrics["eval.accuracy"]
    headline = [f"{record}.{k}" for record, outputs in declarations().items() if record != "eval"
                for k in outputs.headline]

    def score(row: str) -> float:
        means = [s.mean for g in cells[row].values() if (s := g.stats.get("eval.accuracy")) and s.mean is not None]
        return float(np.mean(means)) if means else -math.inf

    def score_text(row: str) -> str:
        """The row's mean, flagged when a value behind it is."""
        if score(row) == -math.inf:
            return "–"
        flagged = any((s := g.stats.get("eval.accuracy")) and s.flags for g in cells[row].values())
        return f"{score(row):.1f}" + (" ⚑" if flagged else "")

    rows = []
    for row in sorted(cells, key=lambda r: (-score(r), r)):
        texts = []
        for column in columns:
            g = cells[row].get(column)
            text = format_stat(accuracy, g.stats.get("eval.accuracy")) if g else "–"
            for key in headline if g else []:
                if key in g.stats:
                    text += f"; {metrics[key].label} {format_stat(metrics[key], g.stats[key])}"
            texts.append(text)
        rows.append([row, *texts, score_text(row)])
    return Section("Strategy leaderboard", [
        "Final global test accuracy (%) and, where measured, each diagnostic's and the strategy's headline "
        "metrics, mean ± 95% CI over seeds; rows sorted by the mean accuracy over columns (⚑: a value behind "
        "it is flagged). A row names its strategy's weighting and the parameters that differ from their "
        "defaults or between its rows.",
        Table(["strategy + client", *columns, "mean over columns (%)"], rows)])


def _wall_time(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.1f} min"


def _provenance(manifest: dict[str, Any] | None, groups: list[Group], varying: list[str], paths: list[Path]) -> Section:
    runs = [r for g in groups for r in g.runs]
    commits = defaultdict(int)
    for run in runs:
        if run.commit:
            commits[run.commit] += 1
    items = [f"Keys that differ between groups: {', '.join(varying) or 'none'}",
             f"Seeds: {', '.join(sorted({str(r.seed) for r in runs}))}",
             "Commits: " + (", ".join(f"{c} ({n} runs)" for c, n in sorted(commits.items())) or "unknown")]
    if manifest is not None:
        preset = f"preset {manifest['preset']}" if manifest.get("preset") else "no preset (the file's own settings)"
        axes = ", ".join(manifest.get("axes", []))
        items[:0] = [f"Sweep: {manifest.get('name')} ({manifest.get('file')}), {preset}, "
                     + (f"axes {axes}" if axes else "no axes (one group, its seeds)")]
    items.append("Inputs: " + ", ".join(str(p) for p in paths))
    table = Table(["run", "group", "seed", "status", "error, or where it runs", "wall time", "commit"],
                  [[r.name, g.label, str(r.seed), r.status, r.note or "", _wall_time(r.seconds), r.commit or "–"]
                   for g in groups for r in g.runs])
    return Section("Runs and provenance", [items, table])


def build_sections(manifest: dict[str, Any] | None, groups: list[Group], comparisons: list[Comparison],
                   unmatched: list[PaperValue], paper: PaperValues | None, headline: list[tuple[Path, str]],
                   images: list[tuple[Path, str]], paths: list[Path], undeclared_runs: list[str],
                   verdict_lines: list[str], outputs: dict[str, Outputs] | None = None,
                   plugin_sections: list[Section] = ()) -> tuple[str, list[Section]]:
    """The report's title and sections, shared by the HTML page and the Markdown file: the
    claim's figure and the verdict first, then the protocol it was measured at, the groups,
    the runs that did not complete (first where none did: a failed or interrupted run's
    page says so at its top), the tables (of ``outputs``, default the declared ones)."""
    axes = list(dict.fromkeys(a for g in groups for a in g.axes))
    runs = [r for g in groups for r in g.runs]
    done = sum(r.status == "completed" for r in runs)
    if manifest:
        preset = manifest.get("preset")
        title = f"fedmech report: sweep {manifest.get('name')}" + (f", preset {preset}" if preset else "")
        title += f" ({len(runs) - done} of {len(runs)} runs not completed)" if done < len(runs) else ""
    elif len(runs) == 1:
        title = f"fedmech run {runs[0].name}: {runs[0].status}"
    else:
        title = "fedmech report"
    varying = differing_keys([g.config for g in groups])
    intro = [f"{len(groups)} groups, {len(runs)} runs, {done} completed. Each number is the mean ± 95% confidence "
             "interval (Student t over seeds) of the runs' values at their final round; n is the number of runs "
             "behind it (n=1: no interval). Only completed runs enter the statistics; the others are listed below. "
             "Accuracies are percent, gaps percentage points (pp); IoUs and R^2 are fractions. An undefined IoU "
             "(two empty circuits) never enters a mean: it is counted, with the empty circuits. A value its "
             "metric's validity rule flags is marked ⚑ with the number of seeds (e.g. one class: the model "
             f"predicts one class for more than {DEGENERATE_FRACTION:.0%} of the test images, so its accuracy is "
             "chance); it never satisfies a published bound."]
    labels = [m.label for m in metrics_of(declarations() if outputs is None else outputs).values()]
    if any("(val-selected)" in label for label in labels):
        intro.append("val-selected: the epoch of a retrained head picked by its accuracy on a validation split of the "
                     "server's audit set, never on the test set; test-selected picks it on the test set, an upper "
                     "bound that no deployment could reach.")
    left_out = [f"{r.name} (group {g.label}, seed {r.seed}): {r.status}" + (f": {r.note}" if r.note else "")
                for g in groups for r in g.runs if r.status != "completed"]
    not_in = Section("Runs not in the statistics", [left_out])
    sections = [not_in] if left_out and not done else []  # a failed or interrupted run's page says so first
    if undeclared_runs:
        sections.append(Section("Runs that recorded no declarations", [
            "These runs list plug-ins under `plugins:` and come from before runs recorded what their plug-ins "
            "declare; a report never imports a run's modules, so their metrics are shown as recorded, by key: "
            "pass `--plugin MODULE` to import them and show them as declared.", undeclared_runs]))
    if not_drawn := [f"{r.name}: the plots of diagnostic {s['diagnostic']}, {s['reason']} (in {s['where']})"
                     for r in runs for s in skipped_plots(r.path)]:
        sections.append(Section("Plots not drawn", [
            "A plug-in's plot that failed, or wrote a file no reader can open, was skipped; the run's other "
            "outputs are whole. Fix the plug-in, then redraw with `fedmech plot RUN_DIR`.", not_drawn]))
    if headline or verdict_lines:
        sections.append(Section("Preserved or misaligned: the headline",
                                [*(Image(p, c) for p, c in headline), *verdict_lines[:1], *([verdict_lines[1:]] if verdict_lines else [])]))
    sections.append(_protocol_section(groups, paper, comparisons))
    sections.append(Section("Groups", [*intro, _groups_table(groups, axes)]))
    if left_out and done:
        sections.append(not_in)
    sections += _metric_tables(groups, declarations() if outputs is None else outputs)
    if paper and comparisons:  # only beside groups whose runs a published value describes (its where)
        sections.append(_paper_section(comparisons, unmatched, paper))
    if board := _leaderboard(groups, varying):
        sections.append(board)
    if images:
        sections.append(Section("Plots", ["Curves: mean over the completed runs of each group; the shaded band is "
                                          "the 95% CI (t) per round, or min–max where fewer than two runs; red "
                                          "rings mark rounds where a seed's value is flagged."]
                                + [Image(path, caption) for path, caption in images]))
    sections += plugin_sections
    sections.append(_provenance(manifest, groups, varying, paths))
    return title, sections


def plugin_plots(runs: list[FolderRun], plots: Path) -> list[Section]:
    """A section per diagnostic, under its name, holding the plots it drew of the first
    completed run that has them (``plots/drawn.json``; on a run's own page, its plots),
    copied into the report's ``plots`` folder: a plug-in's own figures are shown wherever
    its run is."""
    shown: dict[str, tuple[FolderRun, list[Path]]] = {}
    for run in runs:
        drawn = run.path / PLOTS_DIR / DRAWN_FILE
        if run.status != "completed" or not drawn.is_file():
            continue
        for source, files in json.loads(drawn.read_text()).items():
            found = [run.path / PLOTS_DIR / Path(name).name for name in files]
            if source not in ("core", "strategy") and (found := [p for p in found if p.is_file()]):
                shown.setdefault(source, (run, found))
    sections = []
    for source, (run, found) in shown.items():
        plots.mkdir(parents=True, exist_ok=True)
        copies = [shutil.copyfile(path, plots / f"{source}-{path.name}") for path in found]
        sections.append(Section(f"Plots of {source}", [f"As diagnostic {source} drew them for run {run.name}."]
                                + [Image(Path(copy), f"{source}: {path.name}") for copy, path in zip(copies, found)]))
    return sections
