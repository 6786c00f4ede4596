"""The server side of one experiment: set up, run the strategy's loop, write the run folder.

``run_experiment`` is what the ServerApp's ``main`` calls; the in-process runner used in
tests calls it too, with a Grid that runs the ClientApp directly.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedmech_flwr.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, to_record
from fedmech_flwr.config import ExperimentConfig
from fedmech_flwr.experiment import audit_indices, client_partitions, load_data, new_model
from fedmech_flwr.hooks import ClientUpdate, RoundState
from fedmech_flwr.partition import label_histograms
from fedmech_flwr.plotting import plot_run
from fedmech_flwr.protocol import CONFIG_KEY, RoundProtocol, discover_partitions
from fedmech_flwr.pruning import layer_sparsity, overall_sparsity, prune_to
from fedmech_flwr.run_folder import RunFolder
from fedmech_flwr.strategy import STRATEGIES
from fedmech_flwr.training import evaluate, resolve_device

log = logging.getLogger(__name__)

def output_root(cfg: ExperimentConfig, out: str | None = None) -> Path:
    """``--out`` beats ``FEDMECH_OUT`` beats the config's ``output_root``."""
    return Path(out or os.environ.get("FEDMECH_OUT") or cfg.output_root).expanduser().resolve()


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
) -> Path:
    """Run ``cfg`` on ``grid``; return the run folder. Bad input fails before it exists."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = resolve_device(cfg.device)
    bundle = load_data(cfg)
    parts = client_partitions(cfg, bundle)
    audit = torch.from_numpy(audit_indices(cfg, bundle))
    model = new_model(cfg, bundle, device)
    initial = model_arrays(model)
    strategy = STRATEGIES.get(cfg.strategy.name).factory(cfg.strategy.params)
    diagnostics = [(spec, spec.build()) for spec in cfg.diagnostics]
    partitions = discover_partitions(grid, cfg.federation.num_clients, cfg.federation.round_timeout_s)

    folder = RunFolder.create(output_root(cfg, out), cfg.name, run_dir)
    log.info("Run folder: %s", folder.path)
    try:
        folder.write_config(cfg.to_plain())
        folder.write_environment(cfg.seed, str(device), run_config or {})
        hist = label_histograms(parts, bundle.y_train.numpy(), bundle.num_classes)
        folder.write_partitions(parts, hist, list(bundle.class_names), len(audit))
        datasets = {"test": (bundle.x_test.to(device), bundle.y_test.to(device))}
        if len(audit):
            datasets["audit"] = (bundle.x_train[audit].to(device), bundle.y_train[audit].to(device))
        _run_rounds(grid, cfg, folder, partitions, model, initial, strategy, diagnostics, bundle, datasets, device)
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


def _run_rounds(grid, cfg, folder, partitions, model, initial, strategy, diagnostics, bundle, datasets, device) -> None:
    fed = cfg.federation
    x_test, y_test = datasets["test"]

    def build(arrays: NamedArrays):
        m = new_model(cfg, bundle, device)
        load_model_arrays(m, arrays)
        return m.eval()

    def make_state(rnd: int, global_arrays: NamedArrays, previous: NamedArrays, clients: dict[int, ClientUpdate]) -> RoundState:
        return RoundState(rnd, global_arrays, previous, clients, datasets, bundle.num_classes, build, device)

    def reprune(arrays: NamedArrays) -> NamedArrays:
        m = build(arrays)
        prune_to(m, cfg.pruning.target_sparsity, cfg.pruning)
        return model_arrays(m)

    use_reprune = cfg.pruning.mode == "magnitude" and cfg.pruning.server_reprune
    protocol = RoundProtocol(strategy, cfg, partitions, diagnostics, make_state, folder, reprune if use_reprune else None)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
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
        if server_round > 0 and (server_round % fed.checkpoint_every == 0 or server_round == fed.num_rounds):
            folder.checkpoint(server_round, named)
        if server_round == fed.num_rounds:
            folder.final_model(named)
        seconds = time.perf_counter() - summary.started_at if server_round else 0.0
        log.info(
            "round %d/%d | test acc %.2f%% | loss %.4f | clients %d/%d | sparsity %.2f%% | %.1fs",
            server_round, fed.num_rounds, 100 * res.accuracy, res.loss, len(summary.succeeded),
            len(summary.sampled), 100 * sparsity, seconds,
        )
        return MetricRecord({"accuracy": res.accuracy, "loss": res.loss})

    protocol.start(
        grid,
        to_record(initial),
        num_rounds=fed.num_rounds,
        timeout=fed.round_timeout_s,
        train_config=ConfigRecord({CONFIG_KEY: cfg.to_json()}),
        evaluate_fn=evaluate_fn,
    )
