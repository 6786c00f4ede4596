"""The server side of one experiment: set up, run the strategy's loop, write the run folder.

``run_experiment`` is what the ServerApp's ``main`` calls; the in-process runner used in
tests calls it too, with a Grid that runs the ClientApp directly. With ``resume`` it
continues a killed run in its own folder from the last round that folder committed.

Every round ends with the server evaluation, then the numbered checkpoint (every
``federation.checkpoint_every`` rounds), then the resume point (every round): a global
loss or model that is NaN/Inf stops the run before either is written, so both keep the
last good model.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedmech_flwr.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, non_finite
from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.errors import BadFileError
from fedmech_flwr.experiment import (
    audit_indices,
    check_disjoint_from_test,
    client_partitions,
    load_data,
    load_experiment,
    model_builder,
    new_model,
)
from fedmech_flwr.hooks import ClientUpdate, RoundState
from fedmech_flwr.node_data import NodeDataSpec
from fedmech_flwr.partition import label_histograms
from fedmech_flwr.plotting import plot_run
from fedmech_flwr.protocol import (
    CLIENT_IDS_KEY,
    CONFIG_KEY,
    DATA_SPEC_KEY,
    SHARD,
    ClientFailure,
    Roster,
    RoundProtocol,
    discover_nodes,
)
from fedmech_flwr.pruning import layer_sparsity, overall_sparsity, prune_to
from fedmech_flwr.run_folder import CONFIG_FILE, STATE_FILE, ResumePoint, RunFolder
from fedmech_flwr.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.training import evaluate, resolve_device

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """The global model's test loss or weights became NaN/Inf; the run stops."""


def output_root(cfg: ExperimentConfig, out: str | None = None) -> Path:
    """``--out`` beats ``FEDMECH_OUT`` beats the config's ``output_root``."""
    return Path(out or os.environ.get("FEDMECH_OUT") or cfg.output_root).expanduser().resolve()


def resume_config(run_dir: str | Path) -> ExperimentConfig:
    """The resolved config saved in a run folder that can be resumed (else a clear error)."""
    return load_experiment(RunFolder.resume(run_dir).path / CONFIG_FILE)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (``ru_maxrss`` is KiB on Linux).

    Logged every round: with client sampling, the server holds only the sampled clients'
    models, so this must not grow with ``federation.num_clients``.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_experiment(
    grid: Grid,
    cfg: ExperimentConfig,
    *,
    out: str | None = None,
    run_dir: str | None = None,
    run_config: dict[str, Any] | None = None,
    resume: bool = False,
) -> Path:
    """Run ``cfg`` on ``grid``; return the run folder. Bad input fails before it exists.

    With ``resume``, ``run_dir`` is a killed run's folder (and ``cfg`` its config): the run
    continues there from the last round the folder committed.
    """
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = resolve_device(cfg.device)
    bundle = load_data(cfg)
    parts = client_partitions(cfg, bundle)
    audit = torch.from_numpy(audit_indices(cfg, bundle))
    audit_x = bundle.x_train[audit]
    check_disjoint_from_test(audit_x, bundle.x_test)
    model = new_model(cfg, bundle, device)
    audit_set = (audit_x.to(device), bundle.y_train[audit].to(device)) if len(audit) else None
    context = StrategyContext(
        bundle.num_classes, cfg.federation.num_rounds, cfg.seed, cfg.federation.round_timeout_s,
        model_arrays(model), model_builder(cfg, bundle, device), audit_set,
    )
    strategy = STRATEGIES.get(cfg.strategy.name).factory(cfg.strategy.params, context)
    diagnostics = [(spec, spec.build()) for spec in cfg.diagnostics]
    base_config = ConfigRecord({CONFIG_KEY: cfg.to_json(), DATA_SPEC_KEY: NodeDataSpec.of(bundle).to_json()})

    if resume:
        folder = RunFolder.resume(run_dir)
        point = _resume_point(folder, model)
        folder.rewind(point.last_round if point else None)
        folder.set_status("running")
        log.info("Resuming %s after round %s", folder.path, point.last_round if point else "none (from the start)")
    else:
        folder = RunFolder.create(output_root(cfg, out), cfg.name, run_dir)
        point = None
        log.info("Run folder: %s", folder.path)
    try:
        if not resume:
            folder.write_config(cfg.to_plain())
            folder.write_environment(cfg.seed, str(device), run_config or {})
        fed = cfg.federation
        roster = discover_nodes(grid, fed.num_clients, fed.round_timeout_s, base_config, bundle.num_classes)
        hist = label_histograms(parts, bundle.y_train.numpy(), bundle.num_classes)
        folder.write_partitions(_partition_entries(roster, parts, hist), list(bundle.class_names), len(audit))
        _refuse(cfg, folder, roster)
        train_config = ConfigRecord({**base_config, CLIENT_IDS_KEY: roster.ids_json()})
        datasets = {"test": (bundle.x_test.to(device), bundle.y_test.to(device))}
        if audit_set is not None:
            datasets["audit"] = audit_set
        final = _run_rounds(grid, cfg, folder, roster.node_ids, model, point, strategy, diagnostics, bundle, datasets,
                            device, train_config)
        folder.final_model(final)
    except BaseException as err:
        folder.set_status("failed", f"{type(err).__name__}: {err}")
        try:  # a failed run still gets the plots of the rounds it finished
            plot_run(folder.path)
        except Exception as plot_err:  # never hide the run's own error behind a plotting one
            log.warning("could not plot the failed run: %s", plot_err)
        raise
    plot_run(folder.path)
    folder.set_status("completed")
    log.info("Run completed: %s", folder.path)
    return folder.path


def _partition_entries(roster: Roster, parts: list[np.ndarray], hist: np.ndarray) -> list[dict[str, Any]]:
    """partitions.json's client entries: a shard's count and histogram from the server's
    partition, an own-data node's as it reported them, each saying which it is."""
    entries = []
    for cid, info in roster.clients.items():
        if info.source == SHARD:
            entry = {"num_samples": int(len(parts[cid])), "label_histogram": hist[cid].astype(int).tolist()}
        else:
            entry = {"num_samples": info.num_samples, "label_histogram": list(info.label_histogram), "node": info.name}
        entries.append({"partition_id": cid, **entry, "source": info.source})
    return entries


def _refuse(cfg: ExperimentConfig, folder: RunFolder, roster: Roster) -> None:
    """Record the nodes refused at discovery (round 0) and apply the failure policy."""
    fed = cfg.federation
    for node, reason, details in roster.refused:
        folder.failure(0, None, reason, fed.on_client_failure, details, node=node)
        log.warning("node %d was refused before the first round: %s", node, reason)
    if roster.refused and fed.on_client_failure == "fail":
        node, reason, _ = roster.refused[0]
        raise ClientFailure(f"node {node} was refused before the first round ({reason}); "
                            "federation.on_client_failure is 'fail' (set it to 'continue' to run without it)")
    if len(roster.clients) < fed.min_replies:
        raise ClientFailure(f"only {len(roster.clients)} node(s) were accepted, federation.min_replies is "
                            f"{fed.min_replies}")


def _resume_point(folder: RunFolder, model) -> ResumePoint | None:
    """The folder's resume point, checked against the model before anything is rewound;
    None when the run was killed before its first one."""
    point = folder.load_state()
    if point is None:
        return None
    try:
        load_model_arrays(model, point.global_arrays)
    except ValueError as err:
        raise BadFileError(
            f"{folder.path / STATE_FILE} does not fit the model of {folder.path / CONFIG_FILE} ({err}); "
            "it was not written by this run: delete it to restart this run from round 0"
        ) from err
    return point


def _run_rounds(grid, cfg, folder, partitions, model, point, strategy, diagnostics, bundle, datasets, device,
                train_config) -> NamedArrays:
    """Run the rounds after ``point`` (all of them if None); return the last committed
    global model."""
    fed = cfg.federation
    x_test, y_test = datasets["test"]
    start = point or ResumePoint(0, model_arrays(model), {})

    build = model_builder(cfg, bundle, device)

    def make_state(rnd: int, global_arrays: NamedArrays, previous: NamedArrays, clients: dict[int, ClientUpdate]) -> RoundState:
        return RoundState(rnd, global_arrays, previous, clients, datasets, bundle.num_classes, build, device, cfg.seed)

    def reprune(arrays: NamedArrays) -> NamedArrays:
        m = build(arrays)
        prune_to(m, cfg.pruning.target_sparsity, cfg.pruning)
        return model_arrays(m)

    use_reprune = cfg.pruning.mode == "magnitude" and cfg.pruning.server_reprune
    protocol = RoundProtocol(strategy, cfg, partitions, diagnostics, make_state, folder,
                             reprune if use_reprune else None, resume_after=point.last_round if point else None)
    if point:
        protocol.restore(point.protocol_state)
    committed = start

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        nonlocal committed
        named = from_record(arrays)
        load_model_arrays(model, named)
        res = evaluate(model, x_test, y_test, bundle.num_classes, cfg.eval_batch_size)
        sparsity = overall_sparsity(model, include_head=cfg.pruning.include_head)
        summary = protocol.current
        folder.eval(server_round, {
            "loss": res.loss, "accuracy": res.accuracy, "per_class_accuracy": res.per_class_accuracy,
            "sparsity": sparsity, "layer_sparsity": layer_sparsity(model),
            "clients_sampled": list(summary.sampled), "clients_succeeded": list(summary.succeeded),
            "train_round_seconds": summary.train_seconds, "server_peak_rss_mb": peak_rss_mb(),
        })
        _check_finite(server_round, res.loss, named, committed.last_round, folder)
        state = protocol.state()
        if server_round > 0 and (server_round % fed.checkpoint_every == 0 or server_round == fed.num_rounds):
            folder.checkpoint(server_round, named, state)
        committed = ResumePoint(server_round, named, state)
        folder.save_state(committed)
        seconds = time.perf_counter() - summary.started_at if server_round else 0.0
        log.info(
            "round %d/%d | test acc %.2f%% | loss %.4f | clients %d/%d | sparsity %.2f%% | %.1fs",
            server_round, fed.num_rounds, 100 * res.accuracy, res.loss, len(summary.succeeded),
            len(summary.sampled), 100 * sparsity, seconds,
        )
        return MetricRecord({"accuracy": res.accuracy, "loss": res.loss})

    protocol.run(grid, start.global_arrays, train_config, evaluate_fn)
    return committed.global_arrays


def _check_finite(server_round: int, loss: float, arrays: NamedArrays, last_good: int, folder: RunFolder) -> None:
    """Stop a run whose global model diverged, before its state replaces the last good one."""
    bad = non_finite(arrays)
    if math.isfinite(loss) and not bad:
        return
    what = f"non-finite weights in {', '.join(bad[:5])}" if bad else f"test loss {loss}"
    raise Diverged(
        f"round {server_round}: the global model diverged ({what}); the run stopped. "
        f"The last good model is round {last_good}'s, in {folder.path / STATE_FILE} "
        f"(and {folder.path / 'checkpoints'}); lower train.lr or check the clients' data, then start a new run"
    )
