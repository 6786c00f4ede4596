"""``fedmech diagnose``: run a registered diagnostic, with any settings, on a finished run's
saved rounds, without retraining.

A run keeps the global model of every round a diagnostic ran in
(``checkpoints/round_NNN.safetensors``). ``diagnose`` rebuilds what the run's server held
from its config and seed (the test set, the audit set, every client's shard where the
diagnostic asks for them pooled), loads each chosen round's model, runs the diagnostic's
server side on it, and writes the records to ``diagnoses.jsonl`` under the name
``NAME@LABEL`` (its arrays under ``diagnostics/NAME@LABEL/``). The run's own files are never
touched; every view (``status``, ``report``, ``export``) reads both and shows the rerun
beside the original, its labels suffixed ``[LABEL]``, its flags as the records carry them
(computed here with the diagnostic's rules, so no reader runs one). Running it again with
the same label replaces those rounds' records. Unlike the readers, it imports the plug-ins
the run's config names (it reruns their code), and says so.

What it cannot rerun: a diagnostic's client side (the clients' own data and models are not
in the folder), so a diagnostic that needs the clients' round trip is refused; a strategy
that reports another model than the one it sends (FedDyn) gets its reported model back
from the checkpoint's saved strategy state.
"""

from __future__ import annotations

import fcntl
import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedmech_flwr.artifacts.folder import (
    CHECKPOINT_DIR,
    CHECKPOINT_STATE_DIR,
    CONFIG_FILE,
    DIAGNOSES_FILE,
    DIAGNOSTICS_DIR,
    STATE_ROUND,
    RunFolder,
    read_diagnoses,
    round_file,
)
from fedmech_flwr.contracts.hooks import RoundState
from fedmech_flwr.contracts.outputs import RERUN_FLAGS, record_key, rerun_flags
from fedmech_flwr.contracts.strategy import ReportsAnotherModel
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.files import write_text_atomic
from fedmech_flwr.foundation.yaml_text import read_yaml_file
from fedmech_flwr.learning.arrays import load_arrays, model_arrays, save_arrays
from fedmech_flwr.learning.training import resolve_device
from fedmech_flwr.spec.config import apply_overrides, plugin_registries
from fedmech_flwr.spec.experiment import model_builder, new_model, parse_experiment

log = logging.getLogger(__name__)

LABEL = re.compile(r"[A-Za-z0-9._,=+-]{1,80}")
"""What a label may hold: it names the records and a folder."""


def default_label(settings: list[str]) -> str:
    """The settings themselves (``pooled_probe=paper``) without the characters a label may
    not hold, or ``rerun`` without any."""
    return re.sub(r"[^A-Za-z0-9._,=+-]", "", ",".join(settings))[:80] or "rerun"


def diagnose_run(run_dir: Path, name: str, settings: list[str], rounds: list[int] | None,
                 label: str) -> list[dict[str, Any]]:
    """Run diagnostic ``name`` with ``settings`` (``KEY=VALUE`` over the run's own settings
    of that diagnostic, if it ran one) on ``rounds`` of the run in ``run_dir`` (default: the
    rounds the run's own diagnostic of that name ran in, else every checkpointed round);
    write and return the records."""
    if not LABEL.fullmatch(label):
        raise ConfigError(f"expected a label of letters, digits and . _ , = + - (at most 80), got {label!r}", "--as")
    folder = RunFolder(run_dir)
    raw = read_yaml_file(run_dir / CONFIG_FILE)
    if raw.get("plugins"):
        log.warning("%s: importing the run's plug-ins %s to rerun %s: their code runs in this process",
                    run_dir, ", ".join(map(str, raw["plugins"])), name)
    own = [spec for spec in parse_experiment(raw, str(run_dir / CONFIG_FILE)).diagnostics if spec.name == name]
    saved = folder.checkpoint_models()
    if rounds is None:
        rounds = [r for r in saved if own and own[0].due(r)] or saved
    missing = [r for r in rounds if r not in saved]
    if missing:
        have = ", ".join(map(str, saved)) or "none"
        raise ConfigError(f"{run_dir / CHECKPOINT_DIR} holds no model of round(s) {missing}; it has rounds {have} "
                          "(a run keeps every round a diagnostic ran in, and every federation.checkpoint_every)",
                          "--rounds")
    entry = {k: v for k, v in (own[0].to_plain() if own else {"name": name}).items() if k not in ("every", "rounds")}
    entry = apply_overrides({**entry, "rounds": sorted(rounds)}, settings)
    cfg = parse_experiment({**raw, "diagnostics": [entry]}, f"{run_dir / CONFIG_FILE} with {name} {settings}")
    spec = cfg.diagnostics[0]
    diagnostic = spec.build()
    if diagnostic.needs_global_pass():
        raise ConfigError(f"{name} with these settings needs a round trip to the clients (their own data), which a "
                          "finished run cannot make; turn off its client-side options", "--set")
    from fedmech_flwr.app.experiment_run import ServerData, new_strategy  # the server's side, as the run built it

    device = resolve_device(cfg.device)
    server = ServerData.of(cfg, device)
    build = model_builder(cfg, server.bundle, device)
    strategy = new_strategy(cfg, server, model_arrays(new_model(cfg, server.bundle, device)), build)
    recorded = f"{name}@{label}"
    outputs = plugin_registries()["diagnostic"].get(name).outputs
    records = []
    for server_round in sorted(rounds):
        arrays = load_arrays(run_dir / CHECKPOINT_DIR / round_file(server_round))
        if isinstance(strategy, ReportsAnotherModel):
            state = load_arrays(run_dir / CHECKPOINT_STATE_DIR / round_file(server_round), expected=[STATE_ROUND])
            strategy.load_state_arrays({k.removeprefix("strategy/"): v for k, v in state.items()
                                        if k.startswith("strategy/")})
            arrays = strategy.reported(arrays)
        previous = (load_arrays(run_dir / CHECKPOINT_DIR / round_file(server_round - 1))
                    if server_round - 1 in saved else arrays)
        state = RoundState(server_round, arrays, previous, {}, server.datasets, server.bundle.num_classes, build,
                           device, cfg.seed)
        start = time.perf_counter()
        result = diagnostic.server_side(state)
        if result.arrays:
            save_arrays(run_dir / DIAGNOSTICS_DIR / recorded / round_file(server_round), result.arrays)
        record = {"kind": "diagnostic", "round": server_round, "name": recorded,
                  "seconds": time.perf_counter() - start, "settings": spec.to_plain(),
                  **{record_key(k): v for k, v in result.metrics.items()}}
        if outputs is not None:  # readers show the flags without running a rule
            record[RERUN_FLAGS] = rerun_flags(outputs, record)
        records.append(record)
    with _locked(run_dir):
        kept = [r for r in read_diagnoses(run_dir) if not (r["name"] == recorded and r["round"] in rounds)]
        ordered = sorted(kept + records, key=lambda r: (r["name"], r["round"]))
        write_text_atomic(run_dir / DIAGNOSES_FILE, "".join(json.dumps(r) + "\n" for r in ordered))
    return records


@contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """One writer of ``diagnoses.jsonl`` at a time (two ``diagnose`` calls on one run)."""
    with open(run_dir / f".{DIAGNOSES_FILE}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield

