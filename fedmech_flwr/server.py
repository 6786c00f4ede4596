"""The server side of one experiment: set up, run the strategy's loop, write the run folder.

``run_experiment`` is what the ServerApp's ``main`` calls; the in-process runner used in
tests calls it too, with a Grid that runs the ClientApp directly. With ``resume`` it
continues a killed run in its own folder from the last round that folder committed.

``run_experiment`` builds one ``RunContext``; ``RoundEnd`` ends every round after the
round protocol aggregated (and re-pruned) it: diagnostics, the server evaluation, the
divergence check, the numbered checkpoint (every ``federation.checkpoint_every`` rounds),
then the resume point (every round). A global loss or model that is NaN/Inf stops the run
before either is written, so both keep the last good model.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedmech_flwr.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, non_finite
from fedmech_flwr.config import DiagnosticSpec, ExperimentConfig, FlowerAppConfig
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
from fedmech_flwr.hooks import ClientUpdate, Diagnostic, RoundState
from fedmech_flwr.node_data import NodeDataSpec
from fedmech_flwr.outputs import DEGENERATE_FRACTION
from fedmech_flwr.partition import label_histograms
from fedmech_flwr.plotting import plot_run
from fedmech_flwr.protocol import SHARD, ClientFailure, Roster, RoundProtocol, discover_nodes
from fedmech_flwr.pruning import layer_sparsity, overall_sparsity, prune_to
from fedmech_flwr.run_folder import CONFIG_FILE, STATE_FILE, ResumePoint, RunFolder
from fedmech_flwr.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.training import EvalResult, evaluate, resolve_device
from fedmech_flwr.wire import CLIENT_IDS_KEY, CONFIG_KEY, DATA_SPEC_KEY

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """The global model's test loss or weights became NaN/Inf; the run stops."""


@dataclass(frozen=True)
class RunContext:
    """What the rounds of one run need, built once by ``run_experiment`` (or, for a
    user's own Flower app, by ``fedmech_flwr.flower.WithDiagnostics``)."""

    cfg: ExperimentConfig | FlowerAppConfig
    folder: RunFolder
    model: torch.nn.Module
    """The server's model: each round's global model is loaded into it for evaluation."""
    build: Callable[[NamedArrays], torch.nn.Module]
    """A fresh model holding given arrays (re-pruning, diagnostics)."""
    device: torch.device
    num_classes: int
    datasets: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """``test``, and ``audit`` when the experiment has one, on ``device``."""
    strategy: Strategy
    diagnostics: list[tuple[DiagnosticSpec, Diagnostic]]
    partitions: dict[int, int]
    """``{client_id: node_id}`` of the nodes accepted at discovery."""
    train_config: ConfigRecord
    resume_from: ResumePoint | None
    """The killed run's last committed round; None for a new run or one killed before round 0."""


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
        folder.set_status("running")
    else:
        folder = RunFolder.create(output_root(cfg, out), cfg.name, run_dir)
        log.info("Run folder: %s", folder.path)
    with completing(folder):
        point = None
        if resume:
            point = _resume_point(folder, model)
            folder.rewind(point.last_round if point else None)
            log.info("Resuming %s after round %s", folder.path, point.last_round if point else "none (from the start)")
        else:
            folder.write_config(cfg.to_plain())
            folder.write_environment(cfg.seed, str(device), run_config or {})
        fed = cfg.federation
        roster = discover_nodes(grid, fed.num_clients, fed.round_timeout_s, base_config, bundle.num_classes)
        hist = label_histograms(parts, bundle.y_train.numpy(), bundle.num_classes)
        folder.write_partitions(_partition_entries(roster, parts, hist), list(bundle.class_names), len(audit))
        refuse(cfg, folder, roster)
        train_config = ConfigRecord({**base_config, CLIENT_IDS_KEY: roster.ids_json()})
        datasets = {"test": (bundle.x_test.to(device), bundle.y_test.to(device))}
        if audit_set is not None:
            datasets["audit"] = audit_set
        run = RunContext(cfg, folder, model, model_builder(cfg, bundle, device), device, bundle.num_classes, datasets,
                         strategy, diagnostics, roster.node_ids, train_config, point)
        folder.final_model(_run_rounds(grid, run))
    return folder.path


@contextmanager
def completing(folder: RunFolder) -> Iterator[None]:
    """End ``folder`` as completed, with its plots, when the block ends; as failed, with a
    one-line reason (and the plots of the rounds it finished), when the block, the final
    plots or the status write raise. Only a process that dies before it can write the
    status leaves it "running" (readers then see a dead writer: interrupted)."""
    try:
        yield
    except BaseException as err:
        _fail(folder, err)
        try:
            plot_run(folder.path)
        except Exception as plot_err:  # never hide the run's own error behind a plotting one
            log.warning("could not plot the failed run: %s", plot_err)
        raise
    try:
        plot_run(folder.path)
        folder.set_status("completed")
    except BaseException as err:
        _fail(folder, err, "after the last round, drawing the final plots or writing the status: ")
        raise
    log.info("Run completed: %s", folder.path)


def _fail(folder: RunFolder, err: BaseException, context: str = "") -> None:
    """Mark ``folder`` failed with ``err`` as one line; if even that cannot be written (a
    full disk), say so in the log: the status then reads as interrupted."""
    text = str(err).strip()
    reason = f"{context}{type(err).__name__}" + (f": {text.splitlines()[0]}" if text else "")
    try:
        folder.set_status("failed", reason)
    except OSError as status_err:
        log.error("could not record the failure in %s (%s): %s", folder.path, status_err, err)


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


def refuse(cfg: ExperimentConfig, folder: RunFolder, roster: Roster) -> None:
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


def _run_rounds(grid: Grid, run: RunContext) -> NamedArrays:
    """Run the rounds after ``run.resume_from`` (all of them if None); return the last
    committed global model."""
    start = run.resume_from or ResumePoint(0, model_arrays(run.model), {})
    pruning = run.cfg.pruning
    reprune = partial(_reprune, run) if pruning.mode == "magnitude" and pruning.server_reprune else None
    protocol = RoundProtocol(run.strategy, run.cfg, run.partitions, run.diagnostics, partial(round_state, run),
                             run.folder, reprune, resume_after=start.last_round if run.resume_from else None)
    if run.resume_from:
        protocol.restore(run.resume_from.protocol_state)
    round_end = RoundEnd(run, protocol, start)
    protocol.run(grid, start.global_arrays, run.train_config, round_end)
    return round_end.committed.global_arrays


def round_state(run: RunContext, rnd: int, global_arrays: NamedArrays, previous: NamedArrays,
                 clients: dict[int, ClientUpdate]) -> RoundState:
    """What the diagnostics see of round ``rnd``."""
    return RoundState(rnd, global_arrays, previous, clients, run.datasets, run.num_classes, run.build, run.device,
                      run.cfg.seed)


def _reprune(run: RunContext, arrays: NamedArrays) -> NamedArrays:
    """The aggregate pruned back to the target sparsity (the server's mask policy)."""
    model = run.build(arrays)
    prune_to(model, run.cfg.pruning.target_sparsity, run.cfg.pruning)
    return model_arrays(model)


class RoundEnd:
    """Ends each round once the round protocol has aggregated and re-pruned it, in this
    order: evaluation, divergence check, diagnostics, checkpoint, commit (so no diagnostic
    runs on a diverged model). Flower calls it with the experiment's round number and
    global model (round 0: the initial model, evaluated and committed; no diagnostics)."""

    def __init__(self, run: RunContext, protocol: RoundProtocol, committed: ResumePoint) -> None:
        self.run = run
        self.protocol = protocol
        self.committed = committed
        """The last round whose model and state were saved as the resume point."""

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        run, fed = self.run, self.run.cfg.federation
        named = from_record(arrays)
        res, sparsity = self._evaluate(server_round, named)
        _check_finite(server_round, res.loss, named, self.committed.last_round, run.folder)
        if server_round > 0:
            self.protocol.run_diagnostics(server_round, arrays)
        state = self.protocol.state()
        if server_round > 0 and (server_round % fed.checkpoint_every == 0 or server_round == fed.num_rounds):
            run.folder.checkpoint(server_round, named, state)
        self.committed = ResumePoint(server_round, named, state)
        run.folder.save_state(self.committed)
        self._log(server_round, res, sparsity)
        return MetricRecord({"accuracy": res.accuracy, "loss": res.loss})

    def _evaluate(self, server_round: int, named: NamedArrays) -> tuple[EvalResult, float]:
        """Test the global model and write the round's eval record; return the result and
        the model's overall sparsity."""
        run, summary = self.run, self.protocol.current
        load_model_arrays(run.model, named)
        x_test, y_test = run.datasets["test"]
        res = evaluate(run.model, x_test, y_test, run.num_classes, run.cfg.eval_batch_size)
        sparsity = overall_sparsity(run.model, include_head=run.cfg.pruning.include_head)
        run.folder.eval(server_round, {
            "loss": res.loss, "accuracy": res.accuracy, "per_class_accuracy": res.per_class_accuracy,
            "max_predicted_class": res.max_predicted_class, "max_predicted_fraction": res.max_predicted_fraction,
            "sparsity": sparsity, "layer_sparsity": layer_sparsity(run.model),
            "clients_sampled": list(summary.sampled), "clients_succeeded": list(summary.succeeded),
            "train_round_seconds": summary.train_seconds, "server_peak_rss_mb": peak_rss_mb(),
        })
        return res, sparsity

    def _log(self, server_round: int, res: EvalResult, sparsity: float) -> None:
        summary = self.protocol.current
        seconds = time.perf_counter() - summary.started_at if server_round else 0.0
        one_class = (f" ⚑ one class ({100 * res.max_predicted_fraction:.0f}% predicted as class "
                     f"{res.max_predicted_class})" if res.max_predicted_fraction > DEGENERATE_FRACTION else "")
        log.info(
            "round %d/%d | test acc %.2f%%%s | loss %.4f | clients %d/%d | sparsity %.2f%% | %.1fs",
            server_round, self.run.cfg.federation.num_rounds, 100 * res.accuracy, one_class, res.loss,
            len(summary.succeeded), len(summary.sampled), 100 * sparsity, seconds,
        )


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
