"""``fedmech report SWEEP_DIR | RUN_DIR ... --out DIR``: one page over many runs.

Runs whose configs differ only by their seed form a group. For each group the report gives
the mean ± 95% confidence interval (Student t over seeds, n shown) of every declared metric
(``fedmech_flwr.contracts.outputs``: the global model's, each diagnostic's and the strategy's) at
each run's final round (and at the rounds ``--rounds`` asks for), with the flags of its
validity rule: the declared skew figure first, each group's protocol beside the paper's,
per-round curves with seed bands, per-class recall heatmaps, a strategy leaderboard (when
strategies or clients vary), published values held against the groups they describe
(``fedmech_flwr.tools.published``), and where every run came from. Each run's recorded
``plugins:`` are imported first. Only completed runs enter the statistics; running,
failed and pending runs are listed with their status and error.

Writes into DIR::

    index.html     one self-contained page: CSS inline, plots as data: URIs, no script
    report.md      the same tables, plots linked from plots/
    plots/*.png
    summary.json   the groups' statistics for machines; no paths and no wall times, so an
                   interrupted and resumed sweep gives the same file as an uninterrupted one

Inputs: one sweep folder (its ``sweep.json``, written by ``fedmech sweep``), or run folders,
read by ``fedmech_flwr.artifacts.reader`` (the reader ``fedmech status`` and ``fedmech export`` use).

The package's parts: ``statistics`` (groups and their statistics), ``comparisons``
(published values), ``figures``, ``sections`` and ``render`` (the page, as HTML and
Markdown), ``summary`` (the verdict and summary.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fedmech_flwr.artifacts.reader import FolderRun, read_inputs, recorded_outputs
from fedmech_flwr.contracts.outputs import declarations, metrics_of
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.files import write_text_atomic
from fedmech_flwr.foundation.safe_text import printable
from fedmech_flwr.tools.published import read_paper_values
from fedmech_flwr.tools.report.comparisons import Comparison, compare
from fedmech_flwr.tools.report.figures import plot_curves, plot_headline, plot_per_class
from fedmech_flwr.tools.report.render import Image, Section, Table, to_html, to_markdown
from fedmech_flwr.tools.report.sections import build_sections, plugin_plots
from fedmech_flwr.tools.report.statistics import Group, Stat, format_stat, group_stat, make_groups
from fedmech_flwr.tools.report.summary import skew_verdict, summary

__all__ = ["INDEX_FILE", "MARKDOWN_FILE", "PLOTS_DIR", "SUMMARY_FILE", "Comparison", "FolderRun", "Group", "Image",
           "Section", "Stat", "Table", "format_stat", "plot_headline", "read_inputs",
           "read_paper_values", "write_report"]

log = logging.getLogger(__name__)


INDEX_FILE, MARKDOWN_FILE, SUMMARY_FILE, PLOTS_DIR = "index.html", "report.md", "summary.json", "plots"


def write_report(paths: list[str | Path], out_dir: str | Path, paper_file: str | Path | None = None,
                 confidence: float = 0.95, extra_plugins: list[str] = (), rounds: list[int] = ()) -> Path:
    """Write index.html, report.md, plots/ and summary.json for a sweep folder or run
    folders into ``out_dir``; return the path of index.html. ``rounds``: also show every
    metric at these rounds, beside the final one (is an effect transient?)."""
    if bad := [r for r in rounds if isinstance(r, bool) or not isinstance(r, int) or r < 1]:
        raise ConfigError(f"rounds must be whole numbers from 1 (round 0 is the model before training), got "
                          f"{', '.join(map(repr, bad))}", "fedmech report --rounds")
    rounds = sorted(set(rounds))
    paths = [Path(p).expanduser().resolve() for p in paths]
    out_dir = Path(out_dir).expanduser().resolve()
    manifest, runs = read_inputs(paths)
    if not runs:
        raise ConfigError(f"no runs to report on in {', '.join(map(str, paths))}", "fedmech report")
    with recorded_outputs(runs, extra_plugins) as undeclared_runs:
        for problem in undeclared_runs:
            log.warning("%s", printable(problem))
        return _write(manifest, runs, undeclared_runs, out_dir, paper_file, confidence, rounds, paths)


def _write(manifest: dict | None, runs: list[FolderRun], undeclared_runs: list[str], out_dir: Path,
           paper_file: str | Path | None, confidence: float, rounds: list[int], paths: list[Path]) -> Path:
    """``write_report`` once the runs are read, inside the declarations they recorded."""
    groups = make_groups(manifest, runs)
    outputs = declarations([record for run in runs for record in run.records])  # undeclared metrics too
    metrics = metrics_of(outputs)
    for group in groups:
        group.stats = {k: s for k, m in metrics.items() if (s := group_stat(m, group.completed, confidence))}
        group.at_rounds = {r: {k: s for k, m in metrics.items() if (s := group_stat(m, group.completed, confidence, r))}
                           for r in rounds}
    last = max((r["round"] for run in runs for r in run.records), default=0)
    for r in rounds:
        if r > last:
            log.warning("round %d: no run reached it (the latest round recorded is %d)", r, last)
    paper = read_paper_values(Path(paper_file), metrics) if paper_file else None
    comparisons, unmatched = compare(paper, groups) if paper else ([], [])
    plots = out_dir / PLOTS_DIR
    headline = plot_headline(groups, comparisons, plots, paper)
    images = plot_curves(groups, plots) + plot_per_class(groups, plots)
    verdict_lines = skew_verdict(groups)
    title, sections = build_sections(manifest, groups, comparisons, unmatched, paper, headline, images, paths,
                                     undeclared_runs, [line.strip() for line in verdict_lines], outputs,
                                     plugin_plots(runs, plots))
    write_text_atomic(out_dir / MARKDOWN_FILE, to_markdown(title, sections, out_dir))
    write_text_atomic(out_dir / SUMMARY_FILE, json.dumps(
        summary(manifest, groups, comparisons, unmatched, paper, confidence, metrics) | {"verdict": verdict_lines},
        indent=1, allow_nan=False) + "\n")
    index = write_text_atomic(out_dir / INDEX_FILE, to_html(title, sections))
    log.info("report of %d runs in %d groups written to %s", len(runs), len(groups), out_dir)
    return index
