"""One run, from roster to final model: the lifecycle ``fedmech run`` and ``WithDiagnostics`` share.

Both front ends only prepare a ``RunInputs``: ``fedmech_flwr.app.experiment_run``
(``fedmech run``'s ServerApp, and the in-process runner) from an experiment, and
``fedmech_flwr.app.flower.WithDiagnostics`` from a user's own Flower app. ``Run`` does the
rest, in this order:

1. the folder: made (or, resuming, reopened and rewound to the round it last committed),
   with config.yaml and environment.json;
2. the roster: every node asked who it is (``query.identify``), or, for ``fedmech run``'s
   own experiment in Flower's simulation, read from the simulation engine
   (``simulated_roster``); partitions.json written, refused nodes recorded and the
   failure policy applied;
3. the rounds: Flower's loop through the round protocol around the strategy
   (``fedmech_flwr.app.protocol``). Each round ends in ``Run.end_round``: the server's
   evaluation, the divergence check, the due diagnostics (their client-side part through
   ``query.diagnose``), the numbered checkpoint (every ``federation.checkpoint_every``
   rounds, and every round a diagnostic ran in), the resume point, and the console's round
   line;
4. the end: the final model, the plots, and the status: completed, or failed with a
   one-line reason.

A global loss or model that is NaN/Inf stops the run before anything of its round is
committed, so the folder keeps the last good model.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedmech_flwr.app import ray_actors
from fedmech_flwr.app.protocol import (
    SHARD,
    ClientFailure,
    Roster,
    RoundProtocol,
    discover_nodes,
    failure_reason,
    simulated_roster,
)
from fedmech_flwr.app.tensorboard_events import EventFiles
from fedmech_flwr.artifacts.folder import CONFIG_FILE, METRICS_FILE, STATE_FILE, ResumePoint, RunFolder, read_records
from fedmech_flwr.artifacts.plotting import plot_run
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.hooks import DIAGNOSTICS, Resumable, RoundState, decode_results
from fedmech_flwr.contracts.outputs import declarations, duration, headline, notice, recorded_flags, undeclared, unshown
from fedmech_flwr.contracts.strategy import (
    SENT_ACCURACY,
    SENT_LOSS,
    STRATEGIES,
    ReportsAnotherModel,
    StartsFromItsOwnModel,
)
from fedmech_flwr.contracts.wire import CONFIG_KEY, DIAGNOSE_ACTION, PARTITION_IDS_KEY, REPORT_KEY, query_nodes
from fedmech_flwr.foundation.errors import BadFileError, ConfigError, raised_where
from fedmech_flwr.foundation.registry import BUILT_IN
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays, non_finite, to_record
from fedmech_flwr.learning.pruning import layer_sparsity, overall_sparsity
from fedmech_flwr.learning.training import EvalResult, evaluate
from fedmech_flwr.spec.config import ExperimentConfig, FlowerAppConfig

log = logging.getLogger(__name__)

LabelledSet = tuple[torch.Tensor, torch.Tensor]
"""Images ``[N, C, H, W]`` and integer labels ``[N]``."""
Evaluate = Callable[[int, ArrayRecord], MetricRecord | None]
"""Flower's ``evaluate_fn``: (round, global model) -> metrics."""


class Diverged(RuntimeError):
    """The global model's test loss or weights became NaN/Inf; the run stops."""


@dataclass(frozen=True)
class RunInputs:
    """What a front end prepares for a run; ``Run`` needs nothing else."""

    cfg: ExperimentConfig | FlowerAppConfig
    recorded_config: dict[str, Any]
    """config.yaml: the resolved experiment, or a user's app's settings with its strategy."""
    strategy: Strategy
    build: Callable[[NamedArrays], torch.nn.Module]
    """A fresh model holding given arrays, on ``device``, in eval mode."""
    device: torch.device
    num_classes: int
    class_names: list[str]
    datasets: dict[str, LabelledSet]
    """``test``, and ``audit`` when there is one, on ``device``."""
    identify: ConfigRecord
    """What every node is sent when asked who it is, and with every train message: the
    experiment, and what an own-data node's data must match."""
    out_root: Path
    run_dir: str | None = None
    """An exact folder for a new run; with ``resume``, the killed run's folder."""
    resume: bool = False
    shards: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    """The server's own partition: partition id -> (samples, label histogram). A client not
    here is recorded as its node reported it."""
    reprune: Callable[[NamedArrays], NamedArrays] | None = None
    """The server's mask policy after aggregation (magnitude pruning back to the target)."""
    run_config: dict[str, Any] = field(default_factory=dict)
    """Flower's run config, recorded in environment.json."""


def show_logs() -> None:
    """Show the INFO logs of the core and the plug-ins on the console Flower streams (a
    ServerApp, ``fedmech run``'s or a user's own, calls it first). Where a handler is
    already in place (a test's log capture), the lines go there."""
    for name in ("fedmech_flwr", *plugins.PLUGIN_PACKAGES):
        logger = logging.getLogger(name)
        if not logger.hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("fedmech %(levelname)s: %(message)s"))
            logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (``ru_maxrss`` is KiB on Linux).

    Logged every round: with client sampling, the server holds only the sampled clients'
    models, so this must not grow with ``federation.num_clients``.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Run:
    """Owns one run from its roster to its final model (the module docstring's steps)."""

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs = inputs
        self.cfg = inputs.cfg
        self.diagnostics = [(spec, spec.build()) for spec in inputs.cfg.diagnostics]
        self.folder: RunFolder | None = None
        """The run folder, once ``execute`` made or reopened it."""
        self.protocol: RoundProtocol | None = None
        """The round protocol around the strategy, once the roster is known."""
        self.committed: ResumePoint | None = None
        """The last round whose model and state were saved as the resume point."""
        self._grid: Grid | None = None
        self._train_config = ConfigRecord()
        self._started = time.monotonic()
        self._first_end: tuple[int, float] | None = None
        """(round, time) of the first round this process ended: the ETA's start."""
        self.events: EventFiles | None = None
        """The TensorBoard event files (``tensorboard: true``), once the folder exists."""
        self._noticed: set[str] = set()
        """The records whose undeclared metrics this process has said how to declare."""
        self._declared = declarations()
        """What the registered plug-ins declare, recorded in the folder (``RunFolder.write_outputs``)."""
        self._strategy_defaults = (STRATEGIES.get(self.cfg.strategy.name).defaults
                                   if isinstance(self.cfg, ExperimentConfig) else {})
        """The strategy's parameter defaults, recorded beside the declarations (none for a
        user's own Flower app, whose strategy is not a registered one)."""
        self._flags: dict[str, dict[str, str]] = {}
        """The flags of the flagged values recorded so far, by metric and round."""

    def execute(self, grid: Grid, initial: NamedArrays, *, train_config: ConfigRecord | None = None,
                evaluate_config: ConfigRecord | None = None, evaluate_fn: Evaluate | None = None) -> Result:
        """Run every round still to do from ``initial`` (or the resume point) on ``grid``;
        return Flower's ``Result``. ``train_config``, ``evaluate_config`` and
        ``evaluate_fn`` are a user's own Flower app's, passed on to Flower's loop (their
        ``evaluate_fn`` runs before the round's end, and its metrics are what Flower keeps)."""
        self._started = time.monotonic()
        ray_actors.install(grid)  # in simulation, this process holds Flower's Ray actors; before any message
        self.folder = self._open_folder()
        with self._ending():
            return self._rounds(grid, initial, train_config, evaluate_config, evaluate_fn)

    def _rounds(self, grid: Grid, initial: NamedArrays, train_config: ConfigRecord | None,
                evaluate_config: ConfigRecord | None, evaluate_fn: Evaluate | None) -> Result:
        """The run's steps once its folder exists (the module docstring's 1 to 3, and the
        final model)."""
        inputs, fed, folder = self.inputs, self.cfg.federation, self.folder
        if isinstance(inputs.strategy, StartsFromItsOwnModel):
            initial = inputs.strategy.initial_model(initial)
        point = self._resume_point(initial) if inputs.resume else None
        if not inputs.resume:
            folder.write_config(inputs.recorded_config)
            folder.write_environment(self.cfg.seed, str(inputs.device), inputs.run_config)
        kept = read_records(folder.path) if (folder.path / METRICS_FILE).is_file() else []
        self._flags = recorded_flags(self._declared, kept)
        folder.write_outputs(self._declared, self._flags, self._strategy_defaults)
        if self.cfg.tensorboard:  # a resumed run's rewritten whole, from the records its resume point kept
            self.events = EventFiles(folder.path, yaml.safe_dump(inputs.recorded_config, sort_keys=False),
                                     inputs.class_names, kept)
        roster = self._roster(grid)
        folder.write_partitions(self._partition_entries(roster), inputs.class_names,
                                len(inputs.datasets["audit"][1]) if "audit" in inputs.datasets else 0)
        refuse(self.cfg, folder, roster)
        self._grid = grid
        self._train_config = ConfigRecord({**(train_config or {}), **inputs.identify,
                                           PARTITION_IDS_KEY: roster.ids_json()})
        self.committed = point or ResumePoint(0, initial, {})
        self.protocol = RoundProtocol(inputs.strategy, self.cfg, roster.node_ids, folder, inputs.reprune,
                                      resume_after=point.last_round if point else None,
                                      sent_metrics=self.sent_metrics)
        if point is not None:
            self.restore(point.protocol_state)
        if isinstance(inputs.strategy, ReportsAnotherModel):
            log.info("Evaluated and diagnosed: %s (the sent model's accuracy is the strategy metric %s)",
                     inputs.strategy.reports, SENT_ACCURACY)
        result = self.protocol.start(
            grid, to_record(self.committed.global_arrays), num_rounds=fed.num_rounds - self.committed.last_round,
            timeout=fed.round_timeout_s, train_config=self._train_config, evaluate_config=evaluate_config,
            evaluate_fn=partial(self._flower_round_end, evaluate_fn))
        folder.final_model(self.reported(self.committed.global_arrays))
        return result

    @contextmanager
    def _ending(self) -> Iterator[None]:
        """The run's end (step 4). When the block ends: the plots, the event files closed,
        then the status, written last, so that "completed" means every output is on disk;
        where ``fedmech run`` holds the folder's lock, the status goes to it
        (``RunFolder.hand_over``), which keeps the logs and writes the page, then completes
        the run. When the block, or any of these, raises: failed, with a one-line reason
        (``failure_text``) and the plots of the rounds it finished. Only a process that
        dies before it can write the status leaves it "running" (readers then see a dead
        writer: interrupted)."""
        folder = self.folder
        try:
            yield
        except BaseException as err:
            _fail(folder, err, self.protocol.current.server_round if self.protocol else None)
            try:
                self._close_outputs()
            except Exception as output_err:  # never hide the run's own error behind an output's
                log.warning("could not close the outputs of the failed run: %s", output_err)
            raise
        try:
            self._close_outputs()
            if folder.hand_over():
                log.info("Rounds done: %s (fedmech run keeps the logs and writes the page)", folder.path)
                return
            folder.set_status("completed")
        except BaseException as err:
            _fail(folder, err, None, "after the last round, writing its outputs: ")
            raise
        log.info("Run completed: %s", folder.path)

    def _close_outputs(self) -> None:
        """Draw the plots (a plug-in whose plot fails is skipped with a warning), then add
        them to the event files and close those."""
        plots = plot_run(self.folder.path)
        if self.events:
            events, self.events = self.events, None
            events.close(plots)

    def _open_folder(self) -> RunFolder:
        inputs = self.inputs
        if inputs.resume:
            folder = RunFolder.resume(inputs.run_dir)
            folder.set_status("running")
        else:
            folder = RunFolder.create(inputs.out_root, self.cfg.name, inputs.run_dir)
            log.info("Run folder: %s", folder.path)
        return folder

    def _resume_point(self, initial: NamedArrays) -> ResumePoint | None:
        """The folder's resume point (``RunFolder.resume_point``: none later than its
        records), checked against the model (its arrays in the model's order), with the
        folder rewound to it; None when the run was killed before its first one."""
        folder = self.folder
        point = folder.resume_point()
        if point is not None:
            try:
                load_model_arrays(self.inputs.build(initial), point.global_arrays)
            except ValueError as err:
                raise BadFileError(
                    f"{folder.path / STATE_FILE} does not fit the model of {folder.path / CONFIG_FILE} ({err}); "
                    "it was not written by this run: delete it to restart this run from round 0"
                ) from err
            # the file holds arrays in name order; Flower's strategies pair arrays by position
            point = replace(point, global_arrays={k: point.global_arrays[k] for k in initial})
        folder.rewind(point.last_round if point else None)
        log.info("Resuming %s after round %s", folder.path, point.last_round if point else "none (from the start)")
        return point

    def _roster(self, grid: Grid) -> Roster:
        """Who takes part. A run whose server holds every shard (``fedmech run``'s own
        experiment) reads the simulation's nodes without a message; otherwise (real
        SuperNodes, nodes with their own data, a user's own ClientApp, which reports its
        shards) every node is asked."""
        fed, inputs = self.cfg.federation, self.inputs
        if len(inputs.shards) == fed.num_clients and (roster := simulated_roster(grid, fed.num_clients,
                                                                                 fed.round_timeout_s)):
            return roster
        return discover_nodes(grid, fed.num_clients, fed.round_timeout_s, inputs.identify, inputs.num_classes)

    def _partition_entries(self, roster: Roster) -> list[dict[str, Any]]:
        """partitions.json's client entries: a shard's count and histogram from the
        server's partition where it has one, else as the node reported them."""
        entries = []
        for partition_id, info in roster.clients.items():
            shard = self.inputs.shards.get(partition_id) if info.source == SHARD else None
            num, hist = shard or (info.num_samples, list(info.label_histogram))
            entry = {"partition_id": partition_id, "num_samples": num, "label_histogram": hist}
            entries.append({**entry, **({"node": info.name} if info.name else {}), "source": info.source})
        return entries

    # --- resumable state -------------------------------------------------------------------

    def _stateful(self) -> list[tuple[str, Resumable]]:
        owners = [("strategy/", self.inputs.strategy), ("clients/", self.protocol)]
        owners += [(f"diagnostic/{i}.{spec.name}/", diag) for i, (spec, diag) in enumerate(self.diagnostics)]
        return [(prefix, owner) for prefix, owner in owners if isinstance(owner, Resumable)]

    def state(self) -> NamedArrays:
        """The ``Resumable`` strategy's and diagnostics' state and the clients' own, under
        ``strategy/``, ``diagnostic/<index>.<name>/`` and ``clients/<partition id>/``."""
        return {f"{prefix}{k}": v for prefix, owner in self._stateful() for k, v in owner.state_arrays().items()}

    def restore(self, state: NamedArrays) -> None:
        """Give each ``Resumable`` strategy and diagnostic, and the round protocol (the
        clients' states), back what ``state`` saved."""
        for prefix, owner in self._stateful():
            owner.load_state_arrays({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    # --- a round's end -----------------------------------------------------------------------

    def _flower_round_end(self, theirs: Evaluate | None, flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's ``evaluate_fn``: the round's end, with the experiment's round number
        (Flower counts a resumed run's rounds from 1 again; its round 0 was recorded
        before the kill)."""
        if flower_round == 0 and self.protocol.resume_after is not None:
            return None
        server_round = flower_round + self.protocol.offset
        their_metrics = theirs(server_round, arrays) if theirs else None
        ours = self.end_round(server_round, arrays)
        return their_metrics if theirs else ours

    def end_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluation, divergence check, diagnostics, checkpoint, commit, round line (round
        0: the initial model, evaluated and committed; no diagnostics)."""
        fed, folder = self.cfg.federation, self.folder
        named = from_record(arrays)
        shown = self.reported(named)
        res, sparsity = self._evaluate(server_round, shown)
        _check_finite(server_round, res.loss, named, self.committed.last_round, folder)
        if server_round > 0:
            self._diagnose(server_round, arrays if shown is named else to_record(shown), shown)
        state = self.state()
        diagnosed = any(spec.due(server_round) for spec, _ in self.diagnostics)
        if server_round > 0 and (server_round % fed.checkpoint_every == 0 or server_round == fed.num_rounds
                                 or diagnosed):
            folder.checkpoint(server_round, named, state)
        for key, rounds in recorded_flags(self._declared, folder.recent).items():
            self._flags.setdefault(key, {}).update(rounds)
        folder.write_outputs(self._declared, self._flags, self._strategy_defaults)
        self.committed = ResumePoint(server_round, named, state)
        folder.save_state(self.committed)
        if self.events:
            self.events.round(server_round, folder.recent)
        self._notice_undeclared(folder.recent)
        self._log(server_round, res, sparsity)
        return MetricRecord({"accuracy": res.accuracy, "loss": res.loss})

    def reported(self, sent: NamedArrays) -> NamedArrays:
        """The model the round's accuracy describes: ``sent`` (the same object) unless the
        strategy reports another (``ReportsAnotherModel``)."""
        strategy = self.inputs.strategy
        return strategy.reported(sent) if isinstance(strategy, ReportsAnotherModel) else sent

    def sent_metrics(self, sent: NamedArrays) -> dict[str, float]:
        """The round's strategy metrics on the model sent to the clients where the strategy
        reports another: its test accuracy and loss (none where the two are one)."""
        if self.reported(sent) is sent:
            return {}
        x_test, y_test = self.inputs.datasets["test"]
        res = evaluate(self.inputs.build(sent), x_test, y_test, self.inputs.num_classes, self.cfg.eval_batch_size)
        return {SENT_ACCURACY: res.accuracy, SENT_LOSS: res.loss}

    def _evaluate(self, server_round: int, named: NamedArrays) -> tuple[EvalResult, float]:
        """Test the global model and write the round's eval record; return the result and
        the model's overall sparsity."""
        inputs, summary = self.inputs, self.protocol.current
        model = inputs.build(named)
        x_test, y_test = inputs.datasets["test"]
        res = evaluate(model, x_test, y_test, inputs.num_classes, self.cfg.eval_batch_size)
        sparsity = overall_sparsity(model, include_head=self.cfg.pruning.include_head)
        self.folder.eval(server_round, {
            "loss": res.loss, "accuracy": res.accuracy, "per_class_accuracy": res.per_class_accuracy,
            "max_predicted_class": res.max_predicted_class, "max_predicted_fraction": res.max_predicted_fraction,
            "sparsity": sparsity, "layer_sparsity": layer_sparsity(model),
            "clients_sampled": list(summary.sampled), "clients_succeeded": list(summary.succeeded),
            "train_round_seconds": summary.train_seconds, "server_peak_rss_mb": peak_rss_mb(),
            "elapsed_seconds": time.monotonic() - self._started,
        })
        return res, sparsity

    def _diagnose(self, server_round: int, arrays: ArrayRecord, named: NamedArrays) -> None:
        """Run the diagnostics due in ``server_round`` on its global model and the updates
        its clients sent, and record their results."""
        due = [(spec, diag) for spec, diag in self.diagnostics if spec.due(server_round)]
        if not due:
            return
        inputs, summary = self.inputs, self.protocol.current
        if any(diag.needs_global_pass() for _, diag in due):
            self._global_pass(server_round, arrays)
        state = RoundState(server_round, named, summary.sent, summary.updates, inputs.datasets, inputs.num_classes,
                           inputs.build, inputs.device, self.cfg.seed)
        for spec, diag in due:
            start = time.perf_counter()
            result = diag.server_side(state)
            self.folder.diagnostic(server_round, spec.name, result, time.perf_counter() - start)

    def _global_pass(self, server_round: int, arrays: ArrayRecord) -> None:
        """Send the new aggregate to this round's clients for ``client_side_global``."""
        updates, protocol = self.protocol.current.updates, self.protocol
        config = ConfigRecord({**self._train_config, CONFIG_KEY: self.cfg.to_json(), "server-round": server_round})
        nodes = [protocol.partitions[partition_id] for partition_id in updates]
        for reply in query_nodes(self._grid, nodes, DIAGNOSE_ACTION, arrays, config, self.cfg.federation.round_timeout_s):
            partition_id = protocol.node_to_partition[reply.metadata.src_node_id]
            if reply.has_error():
                reason = f"diagnostic pass: {failure_reason(reply.error)}"
                self.folder.failure(server_round, partition_id, reason, "continue", reply.error.reason)
                log.warning("round %d: client %d %s", server_round, partition_id, reason)
                continue
            updates[partition_id].global_diagnostics = decode_results(reply.content.config_records[REPORT_KEY])

    def _notice_undeclared(self, records: list[dict[str, Any]]) -> None:
        """Once per plug-in, at the first round it records metrics it does not declare, one
        line: they are shown as recorded, and how to declare them (``outputs.notice``); a
        warning for a user's plug-in, information for a built-in one (whose undeclared keys
        are per layer of the model, such as matched_avg's). Likewise, once, the keys holding
        numbers that a diagnostic which declares outputs records beside them (``outputs.unshown``)."""
        for record, generic in undeclared(records).items():
            if record in self._noticed:
                continue
            self._noticed.add(record)
            kind, registry, name = (("STRATEGIES", STRATEGIES, self.cfg.strategy.name) if record == "strategy"
                                    else ("DIAGNOSTICS", DIAGNOSTICS, record))
            built_in = name in registry.names() and registry.get(name).source == BUILT_IN
            log.log(logging.INFO if built_in else logging.WARNING, "%s", notice(record, generic, f"{kind} {name!r}"))
        for name, keys in unshown(records).items():
            if f"{name} (unshown)" in self._noticed:
                continue
            self._noticed.add(f"{name} (unshown)")
            built_in = name in DIAGNOSTICS.names() and DIAGNOSTICS.get(name).source == BUILT_IN
            log.log(logging.INFO if built_in else logging.WARNING,
                    "DIAGNOSTICS %r records %s without declaring them: they are kept in metrics.jsonl, but no page, "
                    "CSV or TensorBoard shows them; declare them in its outputs=Outputs(...) (fedmech_flwr.api)",
                    name, ", ".join(keys))

    def _log(self, server_round: int, res: EvalResult, sparsity: float) -> None:
        """The console's round line: the round's declared headline metrics with their
        flags, then the global model's loss and sparsity, the clients that replied, the
        round's time and the run's ETA."""
        summary = self.protocol.current
        seconds = time.perf_counter() - summary.started_at if server_round else 0.0
        log.info("round %d/%d | %s | loss %.4f | sparsity %.2f%% | clients %d/%d | %.1fs%s", server_round,
                 self.cfg.federation.num_rounds, " | ".join(headline(self.folder.recent)), res.loss, 100 * sparsity,
                 len(summary.succeeded), len(summary.sampled), seconds, self._eta(server_round))

    def _eta(self, server_round: int) -> str:
        """`` | ETA 4m10s``: the rounds left at the mean pace of the rounds this process ran."""
        now = time.monotonic()
        if self._first_end is None:
            self._first_end = (server_round, now)
        first, then = self._first_end
        left = self.cfg.federation.num_rounds - server_round
        if server_round == first or not left:
            return ""
        return f" | ETA {duration((now - then) / (server_round - first) * left)}"


NOT_RESUMABLE = (Diverged, ConfigError, BadFileError)
"""Failures a resume would only repeat: the run says what to do instead."""


def _fail(folder: RunFolder, err: BaseException, server_round: int | None, context: str = "") -> None:
    """Mark ``folder`` failed with ``err`` as one line, and whether resuming can help."""
    folder.record_end("failed", context + failure_text(err, server_round), not isinstance(err, NOT_RESUMABLE))


def failure_text(err: BaseException, server_round: int | None) -> str:
    """One line: the round (unless the message names it), the plug-in module and the
    file:line where a plug-in or the user's own code raised it, then ``Type: message``."""
    text = str(err).strip()
    reason = type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")
    if where := raised_where((f.filename, f.lineno) for f in traceback.extract_tb(err.__traceback__)):
        reason = f"in {where}: {reason}"
    if server_round and not text.startswith("round "):
        reason = f"round {server_round}, {reason}"
    return reason


def refuse(cfg: ExperimentConfig | FlowerAppConfig, folder: RunFolder, roster: Roster) -> None:
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


def output_root(cfg: ExperimentConfig | FlowerAppConfig, out: str | None = None) -> Path:
    """``--out`` beats ``FEDMECH_OUT`` beats the config's ``output_root``."""
    return Path(out or os.environ.get("FEDMECH_OUT") or cfg.output_root).expanduser().resolve()
