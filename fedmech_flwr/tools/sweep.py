"""``fedmech sweep``: a grid of runs as one unit of work.

A sweep file names a base experiment and its axes::

    base: ../misalignment_fmnist.yaml          # relative to the sweep file
    name: misalign-v2                           # the sweep folder (default: the file's stem)
    seeds: [0, 1, 2]
    set: {federation.num_rounds: 4}             # overrides for every cell
    grid:                                       # the product of these axes
      data.partition:                           # labelled values ...
        iid: {name: iid}
        a0.05: {name: dirichlet, alpha: 0.05}
      pruning.target_sparsity: [0.95, 0.99]     # ... or a list (labels made from the values)
    zip:                                        # axes that move together, one group each
      - strategy: [{name: fedavg}, {name: fedprox, proximal_mu: 0.01}]
        client: [{name: plain}, {name: proximal}]
    presets:                                    # named overrides, chosen with --preset
      cpu:
        doc: what it trades for time, and why the effect still shows
        set: {train.max_samples_per_round: 500}
        grid: {model: {cnn: {name: simple_cnn}}}   # replaces (or adds) a whole axis
        zip: [...]                              # replaces the zipped group of the same keys
        seeds: [0, 1, 2]

A cell's config is the base, then ``set``, then the preset's ``set``, then its axis
values, then its seed and name: the same ``--set`` items a bare ``fedmech run`` of the
base would take (kept in the manifest). A cell is named by its axis labels and seed
(``a0.05_cnn_s1``); every cell is validated before the first one starts.

The sweep folder, ``<out>/<name>[-<preset>]``, holds ``sweep.json`` (the manifest: cells,
their overrides and resolved configs, status, wall time), ``runs/<cell>/`` (ordinary run
folders) and ``logs/<cell>.log`` (Flower's stream of each cell). Each worker runs its
cells on one warm SuperLink and Ray (``simulation.WarmSimulations``). Running the same
command again continues: completed cells are skipped, cells a kill or Ctrl-C stopped are
resumed from their last completed round (``fedmech run --resume``), failed ones are
rerun only with ``retry_failed``.
"""

from __future__ import annotations

import difflib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.folder import (
    CONFIG_FILE, LOCK_FILE, SWEEP_LOCK_FILE, SWEEP_MANIFEST_FILE, RunFolder, read_records, read_status,
)
from fedmech_flwr.artifacts.liveness import FolderLock, writer_alive
from fedmech_flwr.contracts import outputs, plugins
from fedmech_flwr.foundation.errors import ConfigError, RunFolderError, brief
from fedmech_flwr.foundation.files import write_text_atomic
from fedmech_flwr.foundation.typed import parse_dataclass
from fedmech_flwr.spec.config import (
    ExperimentConfig,
    apply_overrides,
    differing_keys,
    load_plugins,
    override,
    read_yaml,
)
from fedmech_flwr.spec.experiment import check_simulated, parse_experiment
from fedmech_flwr.spec.experiment import memory_available_gib
from fedmech_flwr.tools.finish import finish_run, interrupt_run
from fedmech_flwr.tools.local_flower import stop_all
from fedmech_flwr.tools.simulation import WarmSimulations, private_ray_cpus

log = logging.getLogger(__name__)

MANIFEST_FILE = SWEEP_MANIFEST_FILE
RUNS_DIR = "runs"
LOGS_DIR = "logs"
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SERVER_GIB = 1.0
"""Memory of one run's ServerApp process (it also hosts Flower's simulation engine and
the Ray driver): ``benchmarks/scale.py`` measures 0.9-1.3 GiB, the more with more data."""
ACTOR_GIB = 0.9
"""Memory of one Ray actor running a ClientApp (about 0.85 GiB measured)."""


@dataclass
class Preset:
    doc: str = ""
    """What the preset trades for time, and why the grid's effect still shows."""
    set: dict[str, Any] = field(default_factory=dict)
    """Overrides for every cell (dotted keys), after the sweep's own ``set``."""
    grid: dict[str, Any] = field(default_factory=dict)
    """Axes that replace the sweep's axes of the same key (or add to them)."""
    zip: list[dict[str, Any]] = field(default_factory=list)
    """Zipped groups that replace the sweep's group setting the same keys (or add to them)."""
    seeds: list[int] | None = None


@dataclass
class SweepFile:
    base: str
    """The base experiment file, relative to the sweep file."""
    name: str | None = None
    """The sweep folder's name; default: the sweep file's stem."""
    doc: str = ""
    seeds: list[int] = field(default_factory=lambda: [0])
    set: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, Any] = field(default_factory=dict)
    zip: list[dict[str, Any]] = field(default_factory=list)
    presets: dict[str, Preset] = field(default_factory=dict)


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid: the config keys it sets and its labelled points."""

    name: str
    """The key, or ``key+key`` for a zipped group."""
    keys: tuple[str, ...]
    labels: tuple[str, ...]
    values: tuple[tuple[Any, ...], ...]
    """Per label, one value per key."""


@dataclass
class Cell:
    name: str
    group: str
    """The name without the seed: cells of one group differ only by seed."""
    seed: int
    axes: dict[str, str]
    """Axis name -> label."""
    overrides: list[str]
    config: ExperimentConfig


@dataclass
class Plan:
    """A sweep file expanded and validated: every cell, ready to run."""

    file: Path
    base: Path
    name: str
    preset: str | None
    doc: str
    seeds: list[int]
    axes: list[Axis]
    cells: list[Cell]

    def folder(self, out: str | Path | None) -> Path:
        """``<out>/<name>[-<preset>]``: ``out`` beats ``FEDMECH_OUT`` beats the base's output_root."""
        root = out or os.environ.get("FEDMECH_OUT") or self.cells[0].config.output_root
        return Path(root).expanduser().resolve() / (f"{self.name}-{self.preset}" if self.preset else self.name)


def _slug(value: Any) -> str:
    if isinstance(value, dict):
        named = [str(value["name"])] if "name" in value else []
        return "-".join(named + [f"{k}{_slug(v)}" for k, v in value.items() if k != "name"])
    if isinstance(value, list):
        return "-".join(_slug(v) for v in value)
    return str(value)


def auto_label(key: str, value: Any) -> str:
    """A readable label for an unlabelled axis value: ``{name: dirichlet, alpha: 0.05}`` ->
    ``dirichlet-alpha0.05``; ``dense`` -> ``dense``; ``0.95`` on ``pruning.target_sparsity``
    -> ``target-sparsity0.95``."""
    text = _slug(value) if isinstance(value, (dict, str)) else key.rsplit(".", 1)[-1] + _slug(value)
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def _check_path_name(name: str, where: str) -> None:
    """A name that becomes part of a folder's name (sweep, preset): one path component."""
    if not LABEL.fullmatch(name):
        raise ConfigError(f"{brief(name)} names the sweep folder: use letters, digits, '.', '-' and '_', starting "
                          "with a letter or digit", where)


def _axis(name: str, keys: tuple[str, ...], points: list[tuple[str, tuple[Any, ...]]], where: str) -> Axis:
    if not points:
        raise ConfigError("an axis needs at least one value, got none", where)
    if reserved := sorted({"seed", "name"} & set(keys)):
        raise ConfigError(f"the sweep sets {reserved[0]} of every cell, which would replace this axis's values "
                          "(seeds: [...] for seeds)", where)
    labels = [str(label) for label, _ in points]
    for label in labels:
        if not LABEL.fullmatch(label):
            raise ConfigError(f"label {brief(label)} names run folders: use letters, digits, '.', '-' and '_'", where)
    if repeated := sorted({lab for lab in labels if labels.count(lab) > 1}):
        raise ConfigError(f"values share the label(s) {repeated}; label them yourself: {{label: value, ...}}", where)
    return Axis(name, keys, tuple(labels), tuple(values for _, values in points))


def grid_axis(key: str, raw: Any, where: str) -> Axis:
    """A grid axis: a list of values, or a mapping ``label: value``."""
    if isinstance(raw, dict):
        points = [(str(label), (value,)) for label, value in raw.items()]
    elif isinstance(raw, list):
        points = [(auto_label(key, value), (value,)) for value in raw]
    else:
        raise ConfigError(f"an axis is a list of values or a mapping label: value, got {brief(raw)}", where)
    return _axis(key, (key,), points, where)


def zip_axis(group: Any, where: str) -> Axis:
    """Zipped axes: ``{key: [values], key: [values]}`` of equal lengths, or
    ``{label: {key: value, key: value}, ...}``."""
    if not isinstance(group, dict) or not group:
        raise ConfigError(f"a zipped group is a mapping key: [values], got {brief(group)}", where)
    if all(isinstance(v, list) for v in group.values()):
        keys = tuple(group)
        lengths = {k: len(v) for k, v in group.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"zipped axes must have the same length, got {lengths}", where)
        points = [("-".join(auto_label(k, group[k][i]) for k in keys), tuple(group[k][i] for k in keys))
                  for i in range(len(group[keys[0]]))]
    elif all(isinstance(v, dict) for v in group.values()):
        keys = tuple(next(iter(group.values())))
        for label, values in group.items():
            if tuple(values) != keys:
                raise ConfigError(f"{brief(label)} sets {sorted(values)}; every label of a group sets {sorted(keys)}",
                                  f"{where}.{label}")
        points = [(str(label), tuple(values[k] for k in keys)) for label, values in group.items()]
    else:
        raise ConfigError("a zipped group is either key: [values] or label: {key: value}, not a mix", where)
    return _axis("+".join(keys), keys, points, where)


def _check_set_keys(items: dict[str, Any], axes: list[Axis], where: str) -> None:
    """An override under an axis key would be silently replaced by the axis values, also
    when it is nested (``train: {lr: 0.01}`` under the axis key ``train.lr``)."""
    for key, value in items.items():
        for axis in axes:
            for axis_key in axis.keys:
                if key == axis_key or key.startswith(axis_key + ".") or _holds(value, axis_key, key):
                    shown = axis_key if axis_key.startswith(key + ".") else key
                    raise ConfigError(f"{shown} is set by the axis {axis.name!r}, whose values replace it; "
                                      "put it in the axis values instead", f"{where}.{shown}")
        if key in ("seed", "name"):
            raise ConfigError(f"the sweep sets {key} of every cell (seeds: [...] for seeds)", f"{where}.{key}")


def _holds(value: Any, axis_key: str, key: str) -> bool:
    """Whether the mapping ``value`` set at ``key`` holds the deeper ``axis_key``."""
    if not axis_key.startswith(key + "."):
        return False
    for part in axis_key[len(key) + 1:].split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _only_labels(only: dict[str, list[str]], axes: list[Axis]) -> dict[str, set[str]]:
    """``--only AXIS=LABEL,...`` checked against the axes."""
    by_name = {a.name: a for a in axes}
    out = {}
    for name, labels in only.items():
        if name not in by_name:
            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"no axis {name!r}; the axes are {sorted(by_name)}{hint}", "--only")
        if unknown := sorted(set(labels) - set(by_name[name].labels)):
            raise ConfigError(f"axis {name!r} has no label(s) {unknown}; its labels are {list(by_name[name].labels)}",
                              "--only")
        out[name] = set(labels)
    return out


def load_sweep(path: str | Path, preset: str | None = None, seeds: list[int] | None = None,
               only: dict[str, list[str]] | None = None) -> Plan:
    """Read, expand and validate a sweep file: every cell's config, or an error naming the
    cell and the key."""
    path = Path(path)
    spec = parse_dataclass(SweepFile, read_yaml(path), f"{path}:")
    axes = {key: grid_axis(key, raw, f"{path}: grid.{key}") for key, raw in spec.grid.items()}
    for i, group in enumerate(spec.zip):
        axis = zip_axis(group, f"{path}: zip[{i}]")
        axes[axis.name] = axis
    for key in spec.presets:
        _check_path_name(key, f"{path}: presets.{key}")
    chosen = Preset()
    if preset is not None:
        _check_path_name(preset, "--preset")
        if preset not in spec.presets:
            raise ConfigError(f"no preset {preset!r}; this file has {sorted(spec.presets) or 'none'}", "--preset")
        chosen = spec.presets[preset]
        for key, raw in chosen.grid.items():
            axes[key] = grid_axis(key, raw, f"{path}: presets.{preset}.grid.{key}")
        for i, group in enumerate(chosen.zip):
            axis = zip_axis(group, f"{path}: presets.{preset}.zip[{i}]")
            for old in axes.values():
                if set(old.keys) != set(axis.keys) and set(old.keys) & set(axis.keys):
                    raise ConfigError(f"it sets {sorted(axis.keys)}, the axis {old.name!r} sets {sorted(old.keys)}; "
                                      "a preset's zipped group replaces the one that sets the same keys",
                                      f"{path}: presets.{preset}.zip[{i}]")
            replaced = {n for n, a in axes.items() if set(a.keys) == set(axis.keys)}
            # in the replaced group's place, so that cell names keep their order
            axes = {(axis.name if n in replaced else n): (axis if n in replaced else a) for n, a in axes.items()}
            axes.setdefault(axis.name, axis)
    axis_list = list(axes.values())
    _check_set_keys(spec.set, axis_list, f"{path}: set")
    _check_set_keys(chosen.set, axis_list, f"{path}: presets.{preset}.set")
    seeds = seeds or chosen.seeds or spec.seeds
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be a non-empty list of distinct integers, got {seeds}", "seeds")
    selected = _only_labels(only or {}, axis_list)
    base = (path.parent / spec.base).resolve()
    raw_base = read_yaml(base)
    name = spec.name or path.stem
    _check_path_name(name, f"{path}: name")
    common = [override(k, v) for k, v in {**spec.set, **chosen.set}.items()]
    plugins.load()
    load_plugins(raw_base, str(base))  # an import failure names the base's key, not the first cell's
    cells = []
    for point in itertools.product(*(range(len(a.labels)) for a in axis_list)):
        labels = {a.name: a.labels[i] for a, i in zip(axis_list, point)}
        if any(labels[name_] not in keep for name_, keep in selected.items()):
            continue
        group = "_".join(labels.values()) or "base"
        sets = [override(k, v) for a, i in zip(axis_list, point) for k, v in zip(a.keys, a.values[i])]
        for seed in seeds:
            cell = f"{group}_s{seed}"
            overrides = [*common, *sets, override("seed", seed), override("name", f"{name}-{cell}")]
            config = parse_experiment(apply_overrides(raw_base, overrides), f"{path} cell {cell}")
            check_simulated(config, f"{path} cell {cell}: ")  # every cell runs on the simulation engine
            cells.append(Cell(cell, group, seed, labels, overrides, config))
    if not cells:
        raise ConfigError("no cell is left after --only", "--only")
    return Plan(path.resolve(), base, name, preset, chosen.doc or spec.doc, seeds, axis_list, cells)


def check_fits(cells: list[Cell], parallel: int, cpus: int | None = None, memory_gib: float | None = None) -> int | None:
    """Refuse ``parallel`` runs at once that this machine cannot hold; return the CPUs each
    worker's private Ray may use (None: one run at a time, or the runs share a Ray cluster)."""
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {parallel}", "--parallel")
    local = [c.config for c in cells if c.config.simulation.ray_address is None]
    if parallel == 1 or not local:
        return None
    cpus = cpus or os.cpu_count() or 1
    memory_gib = memory_available_gib() if memory_gib is None else memory_gib
    need = max(cfg.simulation.cpus_per_client for cfg in local)
    if parallel * need > cpus:
        raise ConfigError(
            f"{parallel} runs at once need {parallel * need} CPUs (simulation.cpus_per_client={need} each) and this "
            f"machine has {cpus}; use --parallel {max(1, cpus // need)} or less, or run the cells on a Ray cluster "
            "(simulation.ray_address)", "--parallel")
    ray_cpus = private_ray_cpus(clients_cpus(local), cpus // parallel)
    actors = max(ray_cpus // cfg.simulation.cpus_per_client for cfg in local)  # Flower fills the Ray with actors
    per_run = SERVER_GIB + ACTOR_GIB * actors
    if parallel * per_run > memory_gib:
        raise ConfigError(
            f"{parallel} runs at once need about {parallel * per_run:.1f} GiB ({per_run:.1f} GiB each: the server "
            f"and {actors} client actor(s)) and {memory_gib:.1f} GiB are available; use --parallel "
            f"{max(1, int(memory_gib // per_run))} or less", "--parallel")
    return cpus // parallel


def clients_cpus(configs: list[ExperimentConfig]) -> int:
    """What every client of the largest federation among ``configs`` takes at once:
    clients x ``simulation.cpus_per_client`` (``private_ray_cpus``)."""
    return max((cfg.federation.num_clients * cfg.simulation.cpus_per_client for cfg in configs), default=1)


class Manifest:
    """``sweep.json``: the cells this folder was asked to run and what became of them.
    Rewritten atomically on every change (worker threads share it)."""

    def __init__(self, folder: Path, plan: Plan, parallel: int = 1, command: str | None = None) -> None:
        self.path = folder / MANIFEST_FILE
        self.lock = threading.Lock()
        old = json.loads(self.path.read_text()) if self.path.is_file() else {"cells": []}
        self.cells: dict[str, dict[str, Any]] = {c["name"]: c for c in old["cells"]}
        for cell in plan.cells:
            entry = self.cells.get(cell.name)
            config = cell.config.to_plain()
            if entry and (differ := differing_keys([entry["config"], config])):
                raise RunFolderError(
                    f"{folder} already ran cell {cell.name} with other settings ({', '.join(differ[:6])}); "
                    "rerun with the sweep file it was started with, or use another --out")
            if not entry:
                self.cells[cell.name] = {
                    "name": cell.name, "group": cell.group, "seed": cell.seed, "axes": cell.axes,
                    "run_dir": f"{RUNS_DIR}/{cell.name}", "status": "pending", "error": None, "seconds": 0.0,
                    "overrides": cell.overrides, "config": config,
                }
        self.header = {"file": str(plan.file), "base": str(plan.base), "name": plan.name, "preset": plan.preset,
                       "doc": plan.doc, "seeds": plan.seeds, "axes": [a.name for a in plan.axes],
                       "parallel": parallel, "command": command}
        self.save()

    def update(self, name: str, **fields: Any) -> None:
        with self.lock:
            self.cells[name].update(fields)
            self.save()

    def save(self) -> None:
        write_text_atomic(self.path, json.dumps({**self.header, "cells": list(self.cells.values())}, indent=1))


@dataclass
class Outcome:
    cell: Cell
    status: str
    """completed | failed | interrupted"""
    seconds: float
    error: str | None = None


def _folder_status(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's status.json, or None when there is no run folder (yet)."""
    return read_status(run_dir) if (run_dir / CONFIG_FILE).is_file() else None


def plan_action(entry: dict[str, Any], run_dir: Path, retry_failed: bool) -> str:
    """What to do with a cell: ``skip`` (completed, every round's records there), ``start``,
    ``resume`` (killed or interrupted, completed with rounds' records missing, or failed
    with ``retry_failed``) or ``failed`` (report, do not run)."""
    status = _folder_status(run_dir)
    if status and status["status"] == "completed" and RunFolder(run_dir).missing_rounds() is None:
        return "skip"
    if entry["status"] == "failed" and not retry_failed:
        return "failed"
    if status and writer_alive(status):
        raise RunFolderError(f"{run_dir} is still being written by process {status['pid']}; stop it (or wait), "
                             "then run the sweep again")
    return "resume" if status else "start"


def headline(run_dir: Path) -> str:
    """A finished cell's numbers for its progress line (``outputs.headline``)."""
    try:
        records = read_records(run_dir)
    except (FileNotFoundError, ValueError):
        return ""
    return " | ".join(outputs.headline(records))


def run_sweep(plan: Plan, folder: Path, *, parallel: int = 1, retry_failed: bool = False,
              say: Callable[[str], None] = log.info, verbose: bool = False,
              command: str = "the same `fedmech sweep` command") -> list[Outcome]:
    """Run the plan's cells that are not done yet, ``parallel`` at a time; ``say`` gets one
    line per finished cell; each cell's log gets its console lines (``verbose``: Flower's
    whole log). Ctrl-C or SIGTERM stops every run the sweep started (the cells
    are resumed next time) and re-raises. ``command`` continues the sweep (``cli.sweep_command``):
    kept in sweep.json, where ``fedmech status`` reads it."""
    local = [c.config for c in plan.cells if c.config.simulation.ray_address is None]
    num_cpus = private_ray_cpus(clients_cpus(local), check_fits(plan.cells, parallel))
    with FolderLock(folder / SWEEP_LOCK_FILE, f"run `{command}` again"):
        manifest = Manifest(folder, plan, parallel, command)
        actions = {c.name: plan_action(manifest.cells[c.name], folder / RUNS_DIR / c.name, retry_failed)
                   for c in plan.cells}
        counts = {a: sum(v == a for v in actions.values()) for a in ("skip", "start", "resume", "failed")}
        say(f"sweep {plan.name}{f' (preset {plan.preset})' if plan.preset else ''}: {len(plan.cells)} cells in "
            f"{folder}; {counts['skip']} completed, {counts['resume']} to resume, {counts['start']} to start, "
            f"{counts['failed']} failed before (rerun them with --retry-failed)")
        for cell in plan.cells:
            if actions[cell.name] == "failed":
                say(f"  failed before: {cell.name}: {manifest.cells[cell.name]['error']}")
        todo = [c for c in plan.cells if actions[c.name] in ("start", "resume")]
        return _run_cells(todo, actions, plan, folder, manifest, parallel, num_cpus, say, verbose, command)


def _run_cells(todo: list[Cell], actions: dict[str, str], plan: Plan, folder: Path, manifest: Manifest,
               parallel: int, num_cpus: int, say: Callable[[str], None], verbose: bool,
               command: str) -> list[Outcome]:
    stopping = threading.Event()
    warm = WarmSimulations(num_cpus)  # each worker thread runs its cells on one SuperLink and Ray
    (folder / LOGS_DIR).mkdir(exist_ok=True)

    def run(cell: Cell) -> Outcome:
        run_dir = folder / RUNS_DIR / cell.name
        if stopping.is_set():
            return Outcome(cell, "interrupted", 0.0)
        if actions[cell.name] == "start":
            shutil.rmtree(run_dir, ignore_errors=True)  # what a kill left before the run folder was complete
            run_config = {"experiment": str(plan.base), "overrides": json.dumps(cell.overrides),
                          "out": str(run_dir.parent), "run-dir": str(run_dir)}
        else:
            run_config = {"resume": str(run_dir)}
        manifest.update(cell.name, status="running", error=None)
        start = time.monotonic()
        with open(folder / LOGS_DIR / f"{cell.name}.log", "a") as stream, \
                FolderLock(run_dir / LOCK_FILE, f"run `{command}` again"):
            simulation = warm.get(cell.config.simulation.ray_address)
            result = simulation.run(run_config, cell.config.federation.num_clients, cell.config.simulation,
                                    stream=stream, verbose=verbose)
            status = (finish_run(run_dir, result.status, result.logs_error, page=False)[0]
                      if not stopping.is_set() else read_status(run_dir))
        seconds = time.monotonic() - start
        if stopping.is_set() and status["status"] != "completed":
            outcome = Outcome(cell, "interrupted", seconds)
        elif result.ok and status["status"] == "completed":
            outcome = Outcome(cell, "completed", seconds)
        else:
            reason = status.get("error") or f"Flower run status {result.status}, run folder {status['status']}"
            outcome = Outcome(cell, "failed", seconds, f"{reason} (log: {folder / LOGS_DIR / cell.name}.log)")
        if outcome.status == "failed":
            warm.discard()  # whatever broke the run may have broken its SuperLink or Ray
        manifest.update(cell.name, status=outcome.status, error=outcome.error,
                        seconds=manifest.cells[cell.name]["seconds"] + seconds)
        return outcome

    outcomes: list[Outcome] = []
    started = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="cell")
    futures: set[Future] = {pool.submit(run, cell) for cell in todo}
    try:
        while futures:
            done, futures = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                outcome = future.result()
                outcomes.append(outcome)
                say(_progress_line(outcome, len(outcomes), len(todo), time.monotonic() - started,
                                   folder / RUNS_DIR / outcome.cell.name))
    except BaseException as err:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        while any(not f.done() for f in futures):  # a cell may start between two calls
            stop_all()
            time.sleep(0.2)
        if isinstance(err, KeyboardInterrupt):
            for cell in todo:
                interrupt_run(folder / RUNS_DIR / cell.name, err)
        raise
    finally:
        pool.shutdown(wait=True)
        warm.close()
    return outcomes


def _progress_line(outcome: Outcome, done: int, total: int, elapsed: float, run_dir: Path) -> str:
    """``[done/total] cell status in T | numbers | elapsed | ETA`` (from this invocation's pace)."""
    line = f"[{done}/{total}] {outcome.cell.name} {outcome.status} in {outputs.duration(outcome.seconds)}"
    if outcome.status == "completed":
        line += f" | {headline(run_dir)}"
    elif outcome.error:
        line += f": {outcome.error}"
    eta = elapsed / done * (total - done)
    return f"{line} | elapsed {outputs.duration(elapsed)} | ETA {outputs.duration(eta) if done < total else '-'}"
