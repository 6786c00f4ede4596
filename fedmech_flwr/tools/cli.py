"""``fedmech``: run, validate and plot experiments. The only module that prints.

    fedmech run experiments/default.yaml [--set key=value ...] [--out DIR]
    fedmech run --resume RUN_DIR   (continue a killed run from its last completed round)
    fedmech run --resume RUN_DIR --from-checkpoint N   (... from its numbered checkpoint of round N)
    fedmech deploy-local experiments/smoke.yaml [--set ...] [--out DIR] [--tls] [--auth] [--certs DIR] [--node-data DIR]
    fedmech validate experiments/default.yaml [--set key=value ...]
    fedmech list [KIND] [--plugin MODULE]   (registered datasets, partitions, models, clients, strategies,
        diagnostics, and where each comes from)
    fedmech new strategy|client|diagnostic|model NAME [--dir DIR]   (a start for your own plug-in)
    fedmech plot RUN_DIR
    fedmech status RUN_DIR | SWEEP_DIR [--watch]   (where a run or sweep stands: state, round, ETA)
    fedmech report SWEEP_DIR | RUN_DIR ... --out DIR [--paper FILE]   (one page over many runs)
    fedmech export SWEEP_DIR | RUN_DIR ... --out FILE.csv   (every declared metric as one tidy table)
    fedmech sweep SWEEP.yaml [--preset NAME] [--seeds 0,1,2] [--out DIR] [--parallel N] [--retry-failed]
    fedmech usae SOURCE SOURCE [...] --layer L   (and other commands plug-ins register)

``run`` validates the experiment, then runs it with real ``flwr run`` on a private
local simulation SuperLink; ``deploy-local`` runs it on a private local Deployment Engine
(a SuperLink and one SuperNode per client, optionally with TLS and SuperNode auth). Both
exit 0 only when the run completed (Flower's own run status, and the run folder's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

from fedmech_flwr.artifacts.folder import (
    APP_DIR, CONFIG_FILE, DIAGNOSES_FILE, LOCK_FILE, STATE_FILE, RunFolder, read_outputs, read_records, read_status,
)
from fedmech_flwr.artifacts.liveness import FolderLock
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.commands import COMMANDS, Help
from fedmech_flwr.foundation.errors import BadFileError, ConfigError, RunFolderError, StartError
from fedmech_flwr.foundation.registry import Entry, Registry, did_you_mean
from fedmech_flwr.foundation.safe_text import PrintableFormatter, printable, printable_lines
from fedmech_flwr.foundation.typed import describe_fields
from fedmech_flwr.foundation.yaml_text import read_yaml_file
from fedmech_flwr.spec.config import PARTNERS, PLUGIN_KEYS, ExperimentConfig, differing_keys, plugin_registries
from fedmech_flwr.spec.experiment import check_simulated, load_experiment
from fedmech_flwr.tools.deployment import deploy_local, node_configs, node_data_entries
from fedmech_flwr.tools.finish import (
    PAGE_DIR,
    PAPER_VALUES,
    exit_code,
    finish_run,
    interrupt_run,
    stopped_by_signals,
    write_page,
)
from fedmech_flwr.tools.local_flower import LaunchResult
from fedmech_flwr.tools.simulation import launch

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
LAUNCHERS = ("fedmech_flwr.tools.local_flower", "fedmech_flwr.tools.simulation", "fedmech_flwr.tools.deployment")
"""The modules whose log says what a launch started, and where: shown at INFO."""


def _validate(args: argparse.Namespace):
    return load_experiment(args.experiment, args.set)


def cmd_validate(args: argparse.Namespace) -> int:
    """Check an experiment file, or a sweep file (one with ``base:``) cell by cell."""
    if Path(args.experiment).is_file() and isinstance(doc := read_yaml_file(args.experiment), dict) and "base" in doc:
        from fedmech_flwr.tools.sweep import load_sweep

        if args.set:
            raise ConfigError("--set changes an experiment; a sweep's cells are set in its file (set:, presets:)",
                              args.experiment)
        plan = load_sweep(args.experiment)
        print(printable(f"OK: {args.experiment}: sweep '{plan.name}', {len(plan.cells)} cells, each validated "
                        f"(fedmech sweep {args.experiment} --dry-run lists them)"))
        return EXIT_OK
    cfg = _validate(args)
    fed = cfg.federation
    print(
        f"OK: {printable(args.experiment)}: '{cfg.name}': {cfg.data.dataset.name} / {cfg.data.partition.name}, "
        f"{cfg.model.name}, {fed.num_clients} clients x {fed.num_rounds} rounds, strategy {cfg.strategy.name}, "
        f"client {cfg.client.name}, pruning {cfg.pruning.mode}"
    )
    return EXIT_OK


LIST_KINDS = {"datasets": "dataset", "partitions": "partition", "models": "model",
              "clients": "client", "strategies": "strategy", "diagnostics": "diagnostic"}
"""``fedmech list KIND`` -> plug-in kind (the singular is accepted too)."""


def cmd_list(args: argparse.Namespace) -> int:
    for module in args.plugin:
        plugins.import_plugin(module, "--plugin")
    kinds = list(PLUGIN_KEYS)
    if args.kind:
        kind = LIST_KINDS.get(args.kind, args.kind)
        if kind not in PLUGIN_KEYS:
            hint = did_you_mean(args.kind, [*LIST_KINDS, *PLUGIN_KEYS])
            raise ConfigError(f"unknown kind '{args.kind}'; {hint}choose one of: {', '.join(LIST_KINDS)}",
                              "fedmech list")
        kinds = [kind]
    registries = plugin_registries()
    width = min(shutil.get_terminal_size().columns, 100)
    print("\n\n".join(_listing(kind, registries[kind], width) for kind in kinds))
    return EXIT_OK


def _listing(kind: str, registry: Registry, width: int) -> str:
    """One kind's entries, each with its pairing, where it comes from, what it is (its
    docstring's first paragraph: a method's paper), and its config keys (type, default,
    doc)."""
    plural = next(name for name, singular in LIST_KINDS.items() if singular == kind)
    key = PLUGIN_KEYS[kind]
    if kind == "diagnostic":
        header = (f"{plural.upper()}, listed in {key}: [{{name: NAME, every: N, KEY: VALUE, ...}}, ...] "
                  "(every: run after every N-th round, default 1; or rounds: [3, 10, 20], after exactly those)")
    else:
        header = f"{plural.upper()}, chosen by {key}: {{name: NAME, KEY: VALUE, ...}}"
    return "\n\n".join([header, *(_entry_text(kind, registry.get(name), width) for name in registry.names())])


def _entry_text(kind: str, entry: Entry, width: int) -> str:
    fields = describe_fields(entry.config_cls)
    title = f"  {entry.name}"
    if entry.pairs_with:
        title += f"  (needs {PARTNERS[kind]} {' or '.join(repr(p) for p in entry.pairs_with)})"
    if not fields:
        title += "  (no parameters)"
    lines = [f"{title}  from {entry.origin}"]
    if entry.summary:
        lines.append(textwrap.fill(entry.summary, width, initial_indent=" " * 4, subsequent_indent=" " * 4))
    for f in fields:
        if f.default is None:
            lines.append(f"    {f.key}:")
        elif f.default == "required":
            lines.append(f"    {f.key}: {f.type} (required)")
        else:
            lines.append(f"    {f.key}: {f.type} = {f.default}")
        if f.doc:
            lines.append(textwrap.fill(f.doc, width, initial_indent=" " * 8, subsequent_indent=" " * 8))
    return "\n".join(lines)


def _prepare_run(args: argparse.Namespace) -> tuple[ExperimentConfig, Path, dict[str, str]]:
    """The validated config, a fresh run folder path and the run config ``flwr run`` gets."""
    from fedmech_flwr.app.run import output_root

    cfg = _validate(args)
    root = output_root(cfg, args.out)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = root / f"{cfg.name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        run_dir, suffix = root / f"{cfg.name}-{stamp}-{suffix}", suffix + 1
    run_config = {
        "experiment": str(Path(args.experiment).resolve()),
        "overrides": json.dumps(args.set),
        "out": str(root),
        "run-dir": str(run_dir),
    }
    return cfg, run_dir, run_config


def _resumed(args: argparse.Namespace) -> tuple[ExperimentConfig, Path]:
    """The config and folder of the run ``--resume`` names; refuse another config."""
    from fedmech_flwr.app.experiment_run import resume_config

    cfg = resume_config(args.resume)
    run_dir = Path(args.resume).expanduser().resolve()
    saved = run_dir / CONFIG_FILE
    if args.out:
        raise RunFolderError(f"--out does not apply to --resume: the run continues in {run_dir}")
    if args.set and not args.experiment:
        raise RunFolderError(f"--set cannot change a resumed run, which keeps {saved}; drop --set, or start a new run")
    if args.experiment and (differ := differing_keys([_validate(args).to_plain(), cfg.to_plain()])):
        raise RunFolderError(
            f"a resumed run keeps the config saved in {saved}, but the command line changes "
            f"{', '.join(differ[:8])}; drop the experiment file and --set, or start a new run"
        )
    return cfg, run_dir


def _prepare_resume(run_dir: Path, checkpoint: int | None) -> None:
    """Before Flower starts: check the records, then make numbered checkpoint
    ``checkpoint`` the resume point, or check that the resume point can be read. Damage is
    a ``BadFileError`` that names the file (and line) and says how to go on: for the
    resume point, from the latest intact checkpoint, else from round 0."""
    folder = RunFolder(run_dir)
    try:
        read_records(run_dir)
    except BadFileError as err:
        raise BadFileError(f"{err}, then run `fedmech run --resume {run_dir}` again") from None
    except FileNotFoundError:  # killed before its first record: nothing to check
        pass
    if checkpoint is not None:
        folder.restore_checkpoint(checkpoint)
        return
    try:
        folder.load_state()
    except BadFileError as err:
        state = run_dir / STATE_FILE
        cause = " ".join(str(err.__cause__ or err).split())
        if (last := folder.intact_checkpoint()) is not None:
            then = (f"resume from the checkpoint of round {last} (later rounds run again) with `fedmech run "
                    f"--resume {run_dir} --from-checkpoint {last}`, or delete {state} to restart from round 0")
        else:
            then = f"no intact checkpoint to resume from: delete {state} to restart this run from round 0"
        raise BadFileError(f"{state} is not a readable resume point ({cause}); {then}") from err


def _run_lock(run_dir: Path) -> FolderLock:
    """``run.lock``, held by this process while Flower runs the run: a second ``fedmech run
    --resume`` of the folder is refused at once, naming this process."""
    return FolderLock(run_dir / LOCK_FILE, f"run `fedmech run --resume {run_dir}` again if it did not complete")


def _start_line(cfg: ExperimentConfig, run_dir: Path, engine: str, resume: bool) -> str:
    """The console's first line: what runs, where, on what."""
    fed = cfg.federation
    what = f"continuing {run_dir}" if resume else f"{cfg.name} -> {run_dir}"
    return f"fedmech run: {what} | {fed.num_clients} clients x {fed.num_rounds} rounds | {engine}"


def _engine(cfg: ExperimentConfig) -> str:
    sim = cfg.simulation
    where = f"the Ray cluster at {sim.ray_address}" if sim.ray_address else "a private Ray"
    gpus = f" and {sim.gpus_per_client:g} GPU" if sim.gpus_per_client else ""
    return f"simulation on {where}, {sim.cpus_per_client} CPU(s){gpus} per client"


def _report(result: LaunchResult, run_dir: Path, status: dict, page: str) -> int:
    """The console's last line (status, folder, the run's page, what to do next), from the
    status ``finish_run`` left. Exit 0 only if Flower says ``finished:completed`` and the
    run folder ``completed``."""
    if status["status"] == "missing":
        print(printable(f"failed before the run started (Flower: {result.status}): {_last_error(run_dir, result)}"),
              file=sys.stderr)
        return EXIT_FAILED
    if result.ok and status["status"] == "completed":
        from fedmech_flwr.artifacts.plotting import skipped_plots

        skipped = [f"{s['diagnostic']} ({s['where']})" for s in skipped_plots(run_dir)]
        not_drawn = f" | plots not drawn: {', '.join(skipped)}" if skipped else ""
        print(printable(f"completed: {run_dir} | plots in {run_dir / 'plots'}{not_drawn}, Flower's log in "
                        f"{run_dir / 'logs'} | {page}"))
        return EXIT_OK
    reason = status.get("error") or f"Flower's run status is {result.status}"
    if result.logs_error and result.logs_error not in reason:
        reason += f"; {result.logs_error}"
    resumable = status.get("resumable") or status["status"] == "running"  # its writer gone: the status unwritable
    then = f" | once fixed, continue it: fedmech run --resume {run_dir}" if resumable else ""
    print(printable(f"failed: {reason}{then} | logs in {run_dir / 'logs'} | {page}"), file=sys.stderr)
    return EXIT_FAILED


def _last_error(run_dir: Path, result: LaunchResult) -> str:
    """Why a run failed before its ServerApp made its folder: the last error line of the
    ServerApp's log that the run folder kept, and where the whole log is."""
    log_file = run_dir / "logs" / "flwr_run.log"
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return result.logs_error or "Flower's log was not kept; run it again with -v to see it"
    errors = [line.strip() for line in lines if re.search(r"\b\w+(Error|Exception)\b:", line)]
    return f"{errors[-1] if errors else 'no error line in its log'} (whole log: {log_file})"


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        cfg, run_dir = _resumed(args)
        run_config = {"resume": str(run_dir)}
    elif args.from_checkpoint is not None:
        raise ConfigError("--from-checkpoint only applies with --resume RUN_DIR", "fedmech run")
    elif not args.experiment:
        raise ConfigError("give an experiment file, or --resume RUN_DIR", "fedmech run")
    else:
        cfg, run_dir, run_config = _prepare_run(args)
    check_simulated(cfg, f"{args.resume or args.experiment}: ")
    try:
        with stopped_by_signals(), _run_lock(run_dir):
            if args.resume:
                _prepare_resume(run_dir, args.from_checkpoint)
            print(_start_line(cfg, run_dir, _engine(cfg), bool(args.resume)), flush=True)
            result = launch(run_config, cfg.federation.num_clients, cfg.simulation, verbose=args.verbose)
            status, page = finish_run(run_dir, result.status, result.logs_error, page=True)
    except KeyboardInterrupt as stop:
        print(f"\n{printable(_stopped(run_dir, stop))}", file=sys.stderr)
        return exit_code(stop)
    return _report(result, run_dir, status, page)


def _stopped(run_dir: Path, stop: KeyboardInterrupt) -> str:
    """One line for a run stopped by Ctrl-C, SIGTERM or SIGHUP, once every process it
    started is stopped: where it is, how to continue it, its page."""
    status = read_status(run_dir)["status"]
    if status == "missing":
        return f"stopped before the run folder {run_dir} was made: nothing to resume; start the run again"
    interrupt_run(run_dir, stop)
    page = write_page([run_dir], run_dir)
    if status == "completed":
        return f"stopped after the run completed: run folder {run_dir} | {page}"
    return (f"stopped: every process the run started is stopped; continue it with `fedmech run --resume {run_dir}` "
            f"| {page}")


def cmd_deploy_local(args: argparse.Namespace) -> int:
    cfg, run_dir, run_config = _prepare_run(args)
    node_data = node_data_entries(args.node_data) if args.node_data else []
    try:
        node_configs(cfg.federation.num_clients, node_data)
    except ValueError as err:
        raise ConfigError(str(err), "--node-data") from None
    security = "TLS, SuperNode auth" if args.auth else "TLS" if args.tls or args.certs else "insecure"
    try:
        with stopped_by_signals(), _run_lock(run_dir):
            print(_start_line(cfg, run_dir, f"local Deployment Engine ({security})", False), flush=True)
            result = deploy_local(run_config, cfg.federation.num_clients, tls=args.tls, auth=args.auth,
                                  certs=args.certs, port=args.port, node_data=node_data, verbose=args.verbose)
            status, page = finish_run(run_dir, result.status, result.logs_error, page=True)
    except KeyboardInterrupt as stop:
        print(f"\n{printable(_stopped(run_dir, stop))}", file=sys.stderr)
        return exit_code(stop)
    return _report(result, run_dir, status, page)


NEW_KINDS = ("strategy", "client", "diagnostic", "model")
"""What ``fedmech new`` writes a start for."""


def cmd_new(args: argparse.Namespace) -> int:
    from fedmech_flwr.tools.new_plugin import write_plugin

    files = write_plugin(args.kind, args.name, args.dir.resolve())
    folder = files[0].parent
    print(f"Wrote {', '.join(str(f) for f in files)}\nNext:\n  PYTHONPATH={folder} python -m pytest {files[1]}\n"
          f"  PYTHONPATH={folder} fedmech run {files[2]}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    """Redraw a run's plots from its files and recorded declarations, importing no module
    its folder names: a diagnostic of the user's own gets its declared curves, its own
    figures only with ``--plugin MODULE``, which imports it and says so."""
    from fedmech_flwr.artifacts.plotting import plot_run
    from fedmech_flwr.artifacts.reader import FolderRun, recorded_outputs

    run_dir = Path(args.run_dir)
    for module in args.plugin:
        print(printable(f"importing {module} to draw its plots (--plugin): its code runs in this process"),
              file=sys.stderr)
    config = run_dir / CONFIG_FILE  # without one, plot_run says what is wrong
    runs = [FolderRun(run_dir.name, run_dir, config=read_yaml_file(config), outputs=read_outputs(run_dir))
            ] if config.is_file() else []
    with recorded_outputs(runs, args.plugin) as undeclared_runs:
        for path in plot_run(args.run_dir):
            print(printable(str(path)))
    for problem in undeclared_runs:
        print(printable(problem), file=sys.stderr)
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from fedmech_flwr.tools.report import write_report

    index = write_report(args.paths, args.out, args.paper, extra_plugins=args.plugin, rounds=args.rounds)
    print(printable(f"Report: {index}"))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write the tidy table; a run whose plug-ins cannot be imported (its plug-ins'
    metrics are left out, the rest exported), or that did not complete, is named on stderr."""
    from fedmech_flwr.tools.export import check_out, export_rows, write_csv

    check_out(args.out)
    columns, rows, problems = export_rows(args.paths, args.plugin)
    write_csv(columns, rows, args.out)
    for problem in problems:
        print(printable(problem), file=sys.stderr)
    print(printable(f"{len(rows)} rows of {len({row['run'] for row in rows})} runs -> {args.out}"))
    return EXIT_OK


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Rerun a diagnostic on every completed run the paths name; exit 1 when a run was
    skipped (not completed)."""
    from fedmech_flwr.contracts.outputs import headline
    from fedmech_flwr.artifacts.reader import read_inputs
    from fedmech_flwr.tools.diagnose import default_label, diagnose_run

    plugin_registries()["diagnostic"].get(args.diagnostic, "--diagnostic")  # an unknown name is refused with the closest one
    label = args.label or default_label(args.set)
    _, runs = read_inputs([p.expanduser().resolve() for p in args.paths])
    skipped = 0
    for run in runs:
        if run.status != "completed":
            skipped += 1
            print(printable(f"{run.path}: skipped, it is {run.status} (diagnose reruns completed runs)"), file=sys.stderr)
            continue
        records = diagnose_run(run.path, args.diagnostic, args.set, args.rounds or None, label)
        for record in records:
            print(printable(f"{run.name} round {record['round']}, {record['name']}: "
                            f"{' | '.join(headline([record])) or 'recorded'}"))
    print(printable(f"{len(runs) - skipped} run(s): records in each run's {DIAGNOSES_FILE}, beside its own; "
                    "`fedmech report` and `fedmech export` show both"))
    return EXIT_FAILED if skipped else EXIT_OK


def _rounds(text: str) -> list[int]:
    try:
        rounds = [int(r) for r in text.split(",")]
    except ValueError:
        rounds = [0]
    if min(rounds) < 1:
        raise argparse.ArgumentTypeError(f"expected rounds from 1 like 3,10, got {text!r}")
    return rounds


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None


def _only(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected AXIS=LABEL[,LABEL...], got {item!r}", "--only")
        axis, labels = item.split("=", 1)
        out[axis] = labels.split(",")
    return out


def sweep_command(args: argparse.Namespace, folder: Path) -> str:
    """The exact ``fedmech sweep`` command that continues this sweep, ready to paste: its
    file and every flag that chose its cells (--preset, --seeds, --only), its folder
    (--out, whatever FEDMECH_OUT says then) and --parallel. Rerun without them, a sweep
    of other cells would start (``--seeds 0`` dropped grows the sweep to every seed)."""
    words = ["fedmech", "sweep", args.sweep]
    if args.preset:
        words += ["--preset", args.preset]
    if args.seeds is not None:
        words += ["--seeds", ",".join(map(str, args.seeds))]
    for item in args.only:
        words += ["--only", item]
    words += ["--out", str(folder.parent)]
    if args.parallel != 1:
        words += ["--parallel", str(args.parallel)]
    return shlex.join(words)


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedmech_flwr.foundation.files import check_writable
    from fedmech_flwr.tools.sweep import check_fits, load_sweep, run_sweep

    plan = load_sweep(args.sweep, args.preset, args.seeds, _only(args.only))
    folder = plan.folder(args.out)
    command = sweep_command(args, folder)
    if args.dry_run:
        check_fits(plan.cells, args.parallel)
        check_writable(folder)
        print(printable(f"OK: {args.sweep}: {len(plan.cells)} cells, each validated; they would run in {folder}"))
        for cell in plan.cells:
            print(f"  {cell.name}: {' '.join(cell.overrides)}")
        return EXIT_OK
    try:
        with stopped_by_signals():
            outcomes = run_sweep(plan, folder, parallel=args.parallel, retry_failed=args.retry_failed,
                                 say=lambda line: print(printable(line), flush=True), verbose=args.verbose,
                                 command=command)
    except KeyboardInterrupt as stop:
        print("\n" + printable(f"stopped: every run the sweep started is stopped; continue it with `{command}` "
                               f"({folder}) | {write_page([folder], folder)}"), file=sys.stderr)
        return exit_code(stop)
    failed = [o for o in outcomes if o.status != "completed"]
    print(printable(f"{len(outcomes) - len(failed)} of {len(outcomes)} cell(s) run now completed; sweep folder "
                    f"{folder}"))
    page = write_page([folder], folder)
    for line in _verdict(folder):
        print(printable(line))
    print(printable(page))
    return EXIT_FAILED if failed else EXIT_OK


def _verdict(folder: Path) -> list[str]:
    """The verdict the sweep's page holds (``report.summary.skew_verdict``), from its summary.json."""
    from fedmech_flwr.tools.report import SUMMARY_FILE

    try:
        return json.loads((folder / PAGE_DIR / SUMMARY_FILE).read_text())["verdict"]
    except (OSError, ValueError, KeyError):
        return []


def cmd_status(args: argparse.Namespace) -> int:
    """Print where a run or sweep stands; with --watch, again every --interval seconds
    while it runs (Ctrl-C ends the watch: exit 0). Exit 1 when it failed or was interrupted."""
    from fedmech_flwr.tools.status import look

    if args.interval <= 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}", "fedmech status")
    clear = args.watch and sys.stdout.isatty()
    try:
        while True:
            found, text = look(args.path)
            if args.watch:
                text = f"{dt.datetime.now():%H:%M:%S} (every {args.interval:g}s; Ctrl-C stops)\n{text}\n"
            print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            if not args.watch or not found.running:
                return EXIT_OK if found.ok else EXIT_FAILED
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


HELP = {
    "run": Help(
        "run an experiment with flwr run (local simulation on Ray)",
        "Validate the experiment, then run it with real `flwr run` on a private, short-lived local SuperLink "
        "with Ray. The console shows a start line, one line per round (the declared headline metrics with "
        "their flags, the ETA) and an end line; Flower's and Ray's whole log goes to the run folder's logs/ "
        "(-v streams it too). The run is marked completed only once every output (plots, event files, logs, "
        "its page) is on disk. --resume continues a killed, stopped or failed run in its own folder; one "
        "that failed after its last round only gets what is missing.",
        ("0  the run completed", "1  the run failed (the reason, and how to continue it)",
         "2  bad input, refused before anything starts",
         "130, 143, 129  interrupted by Ctrl-C, SIGTERM, SIGHUP: status interrupted; it says how to resume"),
        ("fedmech run experiments/smoke.yaml --set federation.num_rounds=3",
         "fedmech run --resume ~/fedmech-runs/smoke-20261205-101500")),
    "deploy-local": Help(
        "run an experiment on a local SuperLink and SuperNodes (Deployment Engine)",
        "Run the experiment on Flower's Deployment Engine on this machine: a SuperLink and one SuperNode per "
        "client, optionally with TLS and SuperNode authentication, nodes with their own data (--node-data). "
        "The same console lines and run folder as `fedmech run`.",
        ("0  the run completed", "1  the run failed", "2  bad input, refused before anything starts",
         "130, 143, 129  interrupted by Ctrl-C, SIGTERM, SIGHUP: it says how to resume"),
        ("fedmech deploy-local experiments/smoke.yaml --tls --auth",
         "fedmech deploy-local experiments/smoke.yaml --node-data my_nodes/")),
    "validate": Help(
        "check an experiment file (or a sweep file) without running it",
        "Parse and check the experiment as `fedmech run` would (every key, every plug-in's own rules, the "
        "data on disk), print a one-line summary, and run nothing. A sweep file (one with `base:`) is checked "
        "cell by cell, as `fedmech sweep` would.",
        ("0  valid", "2  invalid: the first line names the key (and the cell) and what is allowed"),
        ("fedmech validate experiments/smoke.yaml --set train.lr=0.1",
         "fedmech validate experiments/demo.yaml")),
    "list": Help(
        "list what is registered (datasets, models, clients, strategies, diagnostics, ...)",
        "List every registered entry with where it comes from (built-in, installed plug-in, --plugin module), "
        "its config keys with types, defaults and docs, and which strategy needs which client.",
        ("0  listed", "2  an unknown kind, or a plug-in that cannot be imported"),
        ("fedmech list strategies", "fedmech list diagnostics --plugin my_lab.geometry")),
    "new": Help(
        "write a start for your own plug-in (module, test, experiment)",
        "Write NAME.py (a registered strategy, client, diagnostic or model that works), test_NAME.py (its "
        "known-answer test) and NAME.yaml (an experiment using it through plugins:) into --dir.",
        ("0  written", "2  a bad name, or files that already exist"),
        ("fedmech new strategy median --dir my_lab/", "fedmech new diagnostic update_norms")),
    "sweep": Help(
        "run a grid of experiments (a sweep file), or continue one",
        "Run every cell of a sweep file (a base experiment, grid and zip axes, seeds, presets), one real "
        "`fedmech run` each, in one sweep folder with a progress line per finished cell. Running it again "
        "continues: completed cells are kept, killed ones resumed.",
        ("0  every cell completed", "1  a cell failed (--retry-failed reruns it)", "2  bad input",
         "130, 143, 129  interrupted by Ctrl-C, SIGTERM, SIGHUP: run the same command again to continue"),
        ("fedmech sweep experiments/smoke_sweep.yaml --seeds 0,1 --out /tmp/sweeps",
         "fedmech sweep experiments/paper/v2_misalignment.yaml --preset cpu --only data.dataset=cifar10")),
    "plot": Help(
        "redraw a run folder's plots from its files",
        "Redraw every plot of a run folder from its records: the global model's, each diagnostic's own, and "
        "the declared curves of a diagnostic that draws none and of the strategy. No module the run folder "
        "names is imported: a diagnostic of your own gets its declared curves (as the run recorded them), its "
        "own figures only with --plugin MODULE, which imports it and says so.",
        ("0  drawn", "2  not a run folder"),
        ("fedmech plot ~/fedmech-runs/smoke-20261205-101500",
         "fedmech plot RUN_DIR --plugin my_lab.geometry")),
    "status": Help(
        "say where a run or a sweep stands (read-only)",
        "Say where a run or sweep folder stands, from its files alone (it writes nothing): a run's state "
        "(running, completed, failed with its reason, or interrupted: its process is gone), round k of N, ETA "
        "and the last round's headline metrics with their flags; a sweep's cells by state, its running cells' "
        "rounds and ETAs, its failed cells' reasons and its ETA. A process on another host (a folder copied "
        "from there) is named, not checked.",
        ("0  completed, or running", "1  failed or interrupted, or a sweep with a failed or interrupted cell "
         "(it shows how to continue)", "2  not a run or sweep folder, or a damaged file"),
        ("fedmech status ~/fedmech-runs/smoke-20261205-101500",
         "fedmech status ~/fedmech-runs/misalign-v2-cpu --watch --interval 10")),
    "report": Help(
        "one page (HTML, Markdown, summary.json) over a sweep folder or run folders",
        "Group runs that differ only in seed, and write one page: the headline figure, the protocol beside "
        "the paper's, each declared metric's table (mean and 95% interval over seeds at the final round, and "
        "at the rounds --rounds names; flags with their seed counts), curves, per-class figures, the "
        "published values checked in direction, a leaderboard and the runs' provenance; plus report.md and "
        "summary.json.",
        ("0  written", "2  nothing to report on, or a damaged file"),
        ("fedmech report ~/fedmech-runs/leaderboard-cpu --out report/ --rounds 3,10",
         "fedmech report RUN_A RUN_B RUN_C --out report/ --paper my_values.yaml")),
    "diagnose": Help(
        "rerun a diagnostic, with other settings, on finished runs' saved rounds",
        "Run a registered diagnostic on the global models a finished run saved (every round a diagnostic ran "
        "in), with the run's own settings of it changed by --set, without retraining. What the run's server "
        "held (test set, audit set, every client's shard) is made again from its config and seed. The "
        "records go to each run's diagnoses.jsonl as NAME@LABEL, beside the run's own, which stay untouched; "
        "status, report and export show both. Its client-side part cannot be rerun (the clients' data and "
        "models are not in the folder).",
        ("0  every run rediagnosed", "1  a run was skipped (not completed); the others were rediagnosed",
         "2  bad input: an unknown diagnostic or setting, a round with no saved model"),
        ("fedmech diagnose RUN_DIR --diagnostic misalignment --set pooled_probe=paper --rounds 3,10,20",
         "fedmech diagnose ~/fedmech-runs/leaderboard-cifar10-cpu_probes --diagnostic misalignment --set "
         "pooled_probe=paper --as paper-probe")),
    "export": Help(
        "every declared metric of a sweep folder or run folders as one tidy CSV table",
        "Write one long table: a row per run x round x declared metric (and per class where the metric has "
        "per-class values), with the run, its sweep and axis labels, seed and status, the metric's label and "
        "unit, the value as the report shows it (percent, percentage points; empty when undefined, never 0) "
        "and its validity flag, as each run recorded its plug-ins' declarations (no module a folder names is "
        "imported); runs with records are exported whatever their status.",
        ("0  written (a run that did not complete, or recorded no declarations, is named on stderr)",
         "2  not a run or sweep folder, a damaged file, or an --out that is not a .csv in an "
         "existing folder"),
        ("fedmech export ~/fedmech-runs/misalign-v2-cpu --out misalign.csv",
         "fedmech export RUN_A RUN_B --out runs.csv --plugin my_lab.geometry")),
}
"""Every built-in subcommand's help, in the order ``fedmech --help`` lists them."""


def _add_command(sub, name: str, fn, text: Help | None = None) -> argparse.ArgumentParser:
    """The subparser of ``name`` with its help (``HELP[name]`` for a built-in command)."""
    text = text or HELP[name]
    epilog = "exit codes:\n" + "\n".join(f"  {line}" for line in text.exits)
    epilog += "\n\nexamples:\n" + "\n".join(f"  {line}" for line in text.examples)
    p = sub.add_parser(name, help=text.line, description=textwrap.fill(text.paragraph, 88), epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(fn=fn)
    return p


def _version() -> str:
    """The package's version and those of what it runs on."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return f"fedmech-flwr {of('fedmech-flwr')} (Flower {of('flwr')}, torch {of('torch')}, Ray {of('ray')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedmech", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Federated learning with Flower, and the mechanistic diagnostics that say why FedAvg fails "
                    "on label-skewed clients.",
        epilog="`fedmech COMMAND --help` describes a command, its exit codes and examples.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, nargs in (("run", cmd_run, "?"), ("deploy-local", cmd_deploy_local, None),
                            ("validate", cmd_validate, None)):  # run's file is optional with --resume
        p = _add_command(sub, name, fn)
        p.add_argument("experiment", nargs=nargs, help="experiment YAML file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set federation.num_rounds=2 (repeatable)")
    for name in ("run", "deploy-local"):
        sub.choices[name].add_argument("--out", help="output root for the run folder (beats FEDMECH_OUT)")
        sub.choices[name].add_argument("-v", "--verbose", action="store_true",
                                       help="stream Flower's and Ray's whole log too (it is always kept in the "
                                            "run folder's logs/)")
    sub.choices["run"].add_argument("--resume", metavar="RUN_DIR",
                                    help="continue a killed or failed run in its folder, from its last completed round")
    sub.choices["run"].add_argument("--from-checkpoint", type=int, metavar="N",
                                    help="with --resume: continue from the numbered checkpoint of round N instead "
                                         "(checkpoints/round_NNN.safetensors); later rounds run again")
    deploy = sub.choices["deploy-local"]
    deploy.add_argument("--tls", action="store_true", help="TLS between SuperLink, SuperNodes and flwr")
    deploy.add_argument("--auth", action="store_true",
                        help="SuperNode authentication: only registered node keys may join (implies --tls)")
    deploy.add_argument("--certs", type=Path, metavar="DIR",
                        help="TLS credentials and node keys made by scripts/make_certs.sh DIR N (implies --tls; "
                             "default: fresh ones for this run)")
    deploy.add_argument("--port", type=int, help="the SuperLink's port (default: a free one)")
    deploy.add_argument("--node-data", type=Path, metavar="DIR",
                        help="one .npz file or image folder per node that brings its own data (node-name: the "
                             "entry's name); the other federation.num_clients nodes hold shards of the dataset")
    p = _add_command(sub, "list", cmd_list)
    p.add_argument("kind", nargs="?", metavar="KIND", help=f"only this kind: {', '.join(LIST_KINDS)}")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this plug-in module first, as an experiment's plugins: list does (repeatable)")
    p = _add_command(sub, "new", cmd_new)
    p.add_argument("kind", choices=NEW_KINDS)
    p.add_argument("name", help="a lowercase identifier: the module's and the registered entry's name")
    p.add_argument("--dir", type=Path, default=Path("."), help="where the files go (default: here)")
    p = _add_command(sub, "sweep", cmd_sweep)
    p.add_argument("sweep", help="sweep YAML file (base experiment, axes, presets)")
    p.add_argument("--preset", help="a named set of overrides from the sweep file (e.g. cpu, gpu)")
    p.add_argument("--seeds", type=_seeds, help="comma-separated seeds, e.g. 0,1,2 (beats the file's seeds)")
    p.add_argument("--out", help="where the sweep folder goes (beats FEDMECH_OUT and the base's output_root)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="run N cells at once (default 1)")
    p.add_argument("--retry-failed", action="store_true", help="rerun cells that failed in an earlier invocation")
    p.add_argument("--only", action="append", default=[], metavar="AXIS=LABEL[,LABEL]",
                   help="run only the cells with these labels on an axis (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="validate every cell and list them; run nothing")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="each cell's log (logs/CELL.log) gets Flower's and Ray's whole log, not only its round lines")
    p = _add_command(sub, "plot", cmd_plot)
    p.add_argument("run_dir")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this plug-in module (repeatable) to draw its own plots; nothing is imported "
                        "without it")
    p = _add_command(sub, "status", cmd_status)
    p.add_argument("path", metavar="RUN_OR_SWEEP", help="a run folder or a sweep folder")
    p.add_argument("--watch", action="store_true", help="redraw until it no longer runs (or Ctrl-C)")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="with --watch: seconds between "
                   "redraws (default 2)")
    p = _add_command(sub, "report", cmd_report)
    p.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR | RUN_DIR", help="a sweep folder, or run folders")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the report goes")
    p.add_argument("--paper", type=Path, metavar="FILE", default=PAPER_VALUES,
                   help="published values to show next to matching groups (default: experiments/paper/values.yaml)")
    p.add_argument("--rounds", type=_rounds, default=[], metavar="R,R",
                   help="also show every metric at these comma-separated rounds, beside the final one (e.g. 3,10)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this plug-in module (repeatable) and show its metrics as it declares them, for "
                        "folders from before runs recorded their declarations; nothing is imported without it")
    p = _add_command(sub, "diagnose", cmd_diagnose)
    p.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR | RUN_DIR", help="a sweep folder, or run folders")
    p.add_argument("--diagnostic", required=True, metavar="NAME", help="the registered diagnostic to rerun")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one of its settings, e.g. --set pooled_probe=paper (repeatable); the rest are the "
                        "run's own settings of it")
    p.add_argument("--rounds", type=_rounds, metavar="R,R",
                   help="the rounds to rerun it on (default: the rounds the run ran it in)")
    p.add_argument("--as", dest="label", metavar="LABEL",
                   help="names the records NAME@LABEL (default: the --set items, e.g. pooled_probe=paper)")
    p = _add_command(sub, "export", cmd_export)
    p.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR | RUN_DIR", help="a sweep folder, or run folders")
    p.add_argument("--out", type=Path, required=True, metavar="FILE.csv", help="the CSV file to write")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this plug-in module (repeatable) and show its metrics as it declares them, for "
                        "folders from before runs recorded their declarations; nothing is imported without it")
    plugins.load()  # plug-ins may register more subcommands (fedmech_flwr.contracts.commands)
    for name in COMMANDS.names():
        command = COMMANDS.get(name).factory
        command.add_arguments(_add_command(sub, name, command.run, command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    for launcher in LAUNCHERS:
        logging.getLogger(launcher).setLevel(logging.INFO)  # what it started, and where
    try:
        parser = build_parser()  # it loads the plug-ins: a broken entry point stops every command
    except ConfigError as err:
        print(f"error: {printable_lines(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `fedmech list | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return EXIT_OK
    except (ConfigError, BadFileError, RunFolderError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {printable_lines(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StartError as err:  # Flower could not start here (every port tried was taken): the run failed
        print(f"error: {printable_lines(str(err))}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as err:  # a full disk, a folder it may not write: one line, never a traceback
        where = f"{err.filename}: " if err.filename else ""
        print(printable(f"error: {where}{err.strerror or err}; free space or fix the folder's permissions, then run "
                        f"`fedmech {args.command}` again"), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # `run` and `sweep` say how to continue them; other commands just stop
        print(f"\nstopped: fedmech {args.command} was interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
