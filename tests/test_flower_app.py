"""The diagnostics in a user's own Flower app (``fedmech_flwr.app.flower``) and its worked
example, ``examples/flower-fedavgm``.

- The API's errors: each names what is wrong and what to do.
- The example app (its own ClientApp, training loop and Flower's FedAvgM), in process and
  (integration) through real ``flwr run``, leaves a run folder whose records match those
  of the same model, data, strategy and seed run by this project's own ServerApp and
  ClientApp. "Match" means: every eval record and every diagnostic record (circuits,
  misalignment) equal, nested keys included, once timings and memory (``seconds``,
  ``per_s``, ``rss_mb`` keys) are dropped; and the final model bitwise equal. Client and
  strategy records are not compared: the example's clients report their own metrics
  (``train_loss``), this project's clients more. Both sides run Flower's own FedAvgM with
  server momentum 0.5 (registered for ``fedmech run`` as a plug-in in the test), so the
  aggregation is the same code; the example seeds model, data and training with
  ``seed_for`` as this project does. The in-process test runs both sides without Ray
  (``run_in_process`` for this project's side); the integration test runs the example with
  ``flwr run`` and the experiment with ``fedmech run``.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from conftest import REPO
from fedmech_flwr.app.flower import WithDiagnostics, attach_diagnostics
from fedmech_flwr.app.inprocess import InProcessGrid, run_in_process
from fedmech_flwr.app.protocol import ClientFailure
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import load_arrays
from fedmech_flwr.models import build_model
from fedmech_flwr.models.simple_cnn import SimpleCNNConfig
from fedmech_flwr.spec.config import SimulationConfig
from fedmech_flwr.spec.experiment import load_experiment
from fedmech_flwr.tools.simulation import launch

EXAMPLE = REPO / "examples" / "flower-fedavgm"
RUN_CONFIG = {
    "dataset": "synthetic", "num-partitions": "3", "alpha": "0.5", "audit-per-class": "20", "head-samples": "40",
    "num-server-rounds": "2", "server-momentum": "0.5", "local-epochs": "2", "lr": "0.05", "batch-size": "32",
    "seed": "0",
}
"""The example at smoke size (values as ``--run-config`` strings; the app converts them)."""

PLUGIN = '''
from dataclasses import dataclass

from flwr.serverapp.strategy import FedAvgM

from fedmech_flwr.contracts.strategy import OFFERED_NODES_ONLY, STRATEGIES


@dataclass
class FedAvgMConfig:
    server_momentum: float = 0.0


@STRATEGIES.register("flower_fedavgm", FedAvgMConfig)
def fedavgm(params, ctx):
    return FedAvgM(server_momentum=params.server_momentum, **OFFERED_NODES_ONLY)
'''
EXPERIMENT = """
name: same-as-example
seed: 0
plugins: [fedavgm_plugin]
data:
  dataset: {name: synthetic, num_train: 300, num_test: 100, num_classes: 4, image_size: 12}
  partition: {name: dirichlet, alpha: 0.5}
  audit_per_class: 20
model: {name: simple_cnn, channels: [4, 8]}
pruning: {mode: dense}
train: {optimizer: sgd, lr: 0.05, momentum: 0.9, epochs: 2, batch_size: 32}
client: {name: plain}
strategy: {name: flower_fedavgm, server_momentum: 0.5}
federation: {num_clients: 3, num_rounds: 2}
diagnostics:
  - {name: circuits, every: 1, ablation_samples: 40}
  - {name: misalignment, every: 1, head_samples: 40, client_stats: [ncm, ccvr]}
"""
"""The example's run, as an experiment of this project."""

MEASURED = re.compile(r"seconds|per_s$|rss_mb$")


def _unmeasured(value):
    """``value`` without timing and memory keys, at any depth."""
    if isinstance(value, dict):
        return {k: _unmeasured(v) for k, v in value.items() if not MEASURED.search(k)}
    if isinstance(value, list):
        return [_unmeasured(v) for v in value]
    return value


def assert_records_match(reference: Path, run: Path) -> None:
    """The module docstring's "match"."""
    for kind in ("eval", "diagnostic"):
        assert _unmeasured(read_records(run, kind)) == _unmeasured(read_records(reference, kind)), kind
    final = load_arrays(run / "model_final.safetensors")
    expected = load_arrays(reference / "model_final.safetensors")
    assert final.keys() == expected.keys() and all(np.array_equal(final[k], expected[k]) for k in expected)


@pytest.fixture
def same_experiment(plugin_site, tmp_path) -> Path:
    """The example's run as an experiment file, its FedAvgM plug-in in ``plugin_site``."""
    (plugin_site / "fedavgm_plugin.py").write_text(PLUGIN)
    (tmp_path / "same.yaml").write_text(EXPERIMENT)
    return tmp_path / "same.yaml"


@pytest.fixture
def example(monkeypatch):
    """The example's package, importable as its ServerApp and ClientApp import it."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from flower_fedavgm import client_app, server_app

    return server_app, client_app


def assert_example_folder(run: Path) -> None:
    """What the example's run folder must hold: circuits and misalignment records every
    round, with the clients' part, and their plots."""
    assert read_status(run)["status"] == "completed"
    diagnostics = read_records(run, "diagnostic")
    assert [(r["round"], r["name"]) for r in diagnostics] == [(r, n) for r in (1, 2) for n in ("circuits", "misalignment")]
    circuits = [r for r in diagnostics if r["name"] == "circuits"]
    assert all(r["circuit_counts"]["local"]["circuits"] > 0 for r in circuits)  # found on the clients, after training
    assert all(r["circuit_counts"]["global"]["circuits"] > 0 for r in circuits)  # the diagnose round trip
    assert all(r["ncm"]["clients"] == 3 for r in diagnostics if r["name"] == "misalignment")
    plots = {p.name for p in (run / "plots").iterdir()}
    assert {"accuracy.png", "circuits_iou.png", "misalignment_accuracy.png", "label_distribution.png"} <= plots


def round_lines(text: str) -> list[str]:
    """The console's round lines, without their time and ETA (``| 1.2s | ETA 2s``)."""
    return [re.sub(r" \| [0-9.]+s( \| ETA \S+)?$", "", line[line.index("round "):]) for line in text.splitlines()
            if re.search(r"\bround \d+/\d+ \|", line)]


def assert_same_run(reference: Path, run: Path) -> None:
    """The same folder (every file's path), and the same status semantics. Flower's own logs
    and the page are left out: ``fedmech run`` copies the logs into logs/ and writes the
    page, report/, when the run ends; a user's own ``flwr run`` does neither."""
    def files(folder: Path) -> set[str]:  # an event file is named by its time, host and pid
        return {re.sub(r"events\.out\.tfevents\..*", "events", str(p.relative_to(folder)))
                for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] not in ("logs", "report")}

    assert files(run) == files(reference)
    assert read_status(run).keys() == read_status(reference).keys()
    assert read_status(run)["status"] == read_status(reference)["status"] == "completed"


def test_the_example_app_in_process_matches_the_same_fedmech_run(example, same_experiment, tmp_path, caplog):
    """Both sides in process: the ServerApp and ClientApp without Ray. The same records,
    folder, status and console round lines; config.yaml records FedAvgM and its settings."""
    caplog.set_level("INFO", logger="fedmech_flwr")
    reference = run_in_process(load_experiment(same_experiment), tmp_path / "reference")
    reference_lines = round_lines(caplog.text)
    caplog.clear()
    server_app, client_app = example
    out = tmp_path / "example"
    run_config = {**RUN_CONFIG, "out": str(out)}
    grid = InProcessGrid(client_app.app, 3)
    for context in grid.contexts.values():
        context.run_config = run_config
    server_app.main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config))
    (run,) = out.iterdir()
    assert_example_folder(run)
    assert_records_match(reference, run)
    assert_same_run(reference, run)
    assert len(reference_lines) == 3 and round_lines(caplog.text) == reference_lines
    assert f"Run folder: {run}" in caplog.text and f"Run completed: {run}" in caplog.text
    recorded = yaml.safe_load((run / "config.yaml").read_text())["strategy"]
    assert recorded["name"] == "flwr.serverapp.strategy.fedavgm.FedAvgM" and recorded["server_momentum"] == 0.5


def test_a_strategy_that_samples_itself_is_recorded_as_it_sampled(example, tmp_path):
    """Flower's FedAvg picks one of the three clients the round protocol offers: the round
    records that one as sampled, and the others as neither trained nor failed."""
    _, client_app = example
    grid = InProcessGrid(client_app.app, 3)
    for context in grid.contexts.values():
        context.run_config = RUN_CONFIG
    build = lambda: client_app.node_model(grid.contexts[1000])  # noqa: E731
    strategy = WithDiagnostics(FedAvg(fraction_train=0.3, min_train_nodes=1, min_available_nodes=1,
                                      fraction_evaluate=0.0), build,
                               {"federation": {"num_clients": 3}, "diagnostics": [{"name": "weight_divergence"}]},
                               test=TEST_SET, out=tmp_path)
    strategy.start(grid, ArrayRecord(build().state_dict()), num_rounds=2)
    evals = read_records(strategy.run_dir, "eval")[1:]
    assert [len(r["clients_sampled"]) for r in evals] == [1, 1]
    assert all(r["clients_sampled"] == r["clients_succeeded"] for r in evals)
    assert not read_records(strategy.run_dir, "failure")
    assert [len(r["clients"]) for r in read_records(strategy.run_dir, "diagnostic")] == [1, 1]


def _flower_sampled(example, out: Path, seed: int) -> list[list[int]]:
    """The clients Flower's FedAvg picks (one of three a round) over five rounds."""
    _, client_app = example
    grid = InProcessGrid(client_app.app, 3)
    for context in grid.contexts.values():
        context.run_config = RUN_CONFIG
    build = lambda: client_app.node_model(grid.contexts[1000])  # noqa: E731
    strategy = WithDiagnostics(FedAvg(fraction_train=0.3, min_train_nodes=1, min_available_nodes=1,
                                      fraction_evaluate=0.0), build,
                               {"seed": seed, "federation": {"num_clients": 3}}, test=TEST_SET, out=out)
    strategy.start(grid, ArrayRecord(build().state_dict()), num_rounds=5)
    return [r["clients_sampled"] for r in read_records(strategy.run_dir, "eval")[1:]]


def test_flower_samples_other_clients_each_round_and_the_same_ones_per_seed(example, tmp_path):
    """Building a model no longer reseeds the globals Flower samples from: its draw moves
    from round to round, and the same seed draws the same clients (a resumed run too:
    each round's draw is seeded by the run's seed and the round)."""
    drawn = _flower_sampled(example, tmp_path / "a", seed=0)
    assert len({tuple(s) for s in drawn}) > 1
    assert _flower_sampled(example, tmp_path / "b", seed=0) == drawn
    assert _flower_sampled(example, tmp_path / "c", seed=1) != drawn


def test_evaluate_messages_a_clientapp_cannot_answer_are_explained_once(example, tmp_path, caplog):
    """Flower's strategies send evaluate messages by default (fraction_evaluate=1.0); a
    ClientApp without ``@app.evaluate()`` answers each with an error. The run still
    completes, and one warning says what to do."""
    _, client_app = example
    grid = InProcessGrid(client_app.app, 3)
    for context in grid.contexts.values():
        context.run_config = RUN_CONFIG
    build = lambda: client_app.node_model(grid.contexts[1000])  # noqa: E731
    strategy = WithDiagnostics(FedAvg(), build, {"federation": {"num_clients": 3}}, test=TEST_SET, out=tmp_path)
    strategy.start(grid, ArrayRecord(build().state_dict()), num_rounds=2)
    assert read_status(strategy.run_dir)["status"] == "completed"
    hints = [r.getMessage() for r in caplog.records if "@app.evaluate()" in r.getMessage()]
    assert len(hints) == 1 and hints[0].startswith("round 1: 3 of 3 clients answered the strategy's evaluate"), hints


@pytest.mark.integration
def test_flwr_run_of_the_example_matches_the_same_fedmech_run(same_experiment, plugin_site, tmp_path):
    """``flwr run examples/flower-fedavgm`` and ``fedmech run`` of the same experiment, each
    on a private SuperLink with Ray (about 60 s each)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(same_experiment), "--out",
                           str(tmp_path / "reference")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (reference,) = (tmp_path / "reference").iterdir()
    out = tmp_path / "example"
    log = io.StringIO()
    result = launch({**RUN_CONFIG, "out": str(out)}, 3, SimulationConfig(), stream=log, app=EXAMPLE)
    assert result.ok, log.getvalue()[-4000:]
    (run,) = out.iterdir()
    assert_example_folder(run)
    assert_records_match(reference, run)
    assert_same_run(reference, run)
    assert round_lines(log.getvalue()) == round_lines(done.stdout + done.stderr) != []


# --- the API's errors -----------------------------------------------------------------------

def tiny_model():
    return build_model("simple_cnn", SimpleCNNConfig(channels=[4, 8]), in_channels=1, num_classes=4, image_size=12)


TEST_SET = (torch.zeros(8, 1, 12, 12), torch.arange(8) % 4)


def diagnosed(diagnostics: list[dict], audit=TEST_SET, builder=tiny_model, **config) -> WithDiagnostics:
    config = {"federation": {"num_clients": 2}, "diagnostics": diagnostics, **config}
    return WithDiagnostics(FedAvg(), builder, config, test=TEST_SET, audit=audit)


def test_a_diagnostic_that_needs_the_audit_set_refuses_to_start_without_one():
    with pytest.raises(ConfigError) as err:
        diagnosed([{"name": "circuits"}, {"name": "misalignment", "head_samples": 4}], audit=None)
    assert "diagnostic 'misalignment' needs the server's audit set" in str(err.value)
    assert "audit=(images, labels)" in str(err.value) and "diagnostics[1]" in str(err.value)


def test_diagnostics_rules_name_the_key():
    with pytest.raises(ConfigError, match=r"did you mean 'circuits'.*diagnostics\[0\]\.name"):
        diagnosed([{"name": "circuit"}])
    with pytest.raises(ConfigError, match=r"leaves none to select epochs on.*diagnostics\[0\]\.validation_fraction"):
        diagnosed([{"name": "misalignment"}])
    with pytest.raises(ConfigError, match="num_classes comes from the model"):
        diagnosed([], num_classes=4)


def test_the_settings_may_be_a_yaml_file(tmp_path):
    (tmp_path / "app.yaml").write_text("name: lab\nseed: 3\nfederation: {num_clients: 2}\ndiagnostics: [{name: circuits}]\n")
    cfg = WithDiagnostics(FedAvg(), tiny_model, tmp_path / "app.yaml", test=TEST_SET).cfg
    assert (cfg.name, cfg.seed, cfg.num_classes, [d.name for d in cfg.diagnostics]) == ("lab", 3, 4, ["circuits"])
    (tmp_path / "bad.yaml").write_text("federation: {num_clients: 2, clients_per_round: 3}\n")
    with pytest.raises(ConfigError, match=r"must be <= num_clients.*bad.yaml: federation.clients_per_round"):
        WithDiagnostics(FedAvg(), tiny_model, tmp_path / "bad.yaml", test=TEST_SET)


def test_an_unbalanced_audit_set_is_refused():
    with pytest.raises(ValueError, match=r"same number of images of every class.*\[3, 2, 2, 1\]"):
        diagnosed([], audit=(torch.zeros(8, 1, 12, 12), torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])))


def test_a_model_without_the_fedmech_contract_is_refused():
    with pytest.raises(TypeError, match=r"returned a Linear, but the diagnostics need a fedmech_flwr.models.FedMechModel"):
        diagnosed([], builder=lambda: torch.nn.Linear(4, 4))


def test_attach_comes_after_the_train_function():
    app = ClientApp()
    with pytest.raises(RuntimeError, match=r"call it after your @app.train\(\) function"):
        attach_diagnostics(app, lambda context: tiny_model(), lambda context: TEST_SET)


def test_a_train_message_without_the_wrapper_is_answered_by_the_users_function_alone(flower_identity):
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    attach_diagnostics(app, lambda context: tiny_model(), lambda context: TEST_SET)
    sent = Message(RecordDict({"arrays": ArrayRecord(tiny_model().state_dict())}), dst_node_id=2, message_type="train")
    context = Context(run_id=1, node_id=2, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                      run_config={})
    reply = app(sent, context)
    assert list(reply.content.keys()) == ["arrays"]
    assert {"query.identify", "query.diagnose"} <= set(app._registered_funcs)


def test_a_node_without_a_partition_is_refused_before_the_first_round(tmp_path):
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        raise AssertionError("no round may start")

    attach_diagnostics(app, lambda context: tiny_model(), lambda context: TEST_SET)
    grid = InProcessGrid(app, 2, node_configs=[{"partition-id": 0, "num-partitions": 2}, {}])
    strategy = WithDiagnostics(FedAvg(), tiny_model, {"federation": {"num_clients": 2}}, test=TEST_SET, out=tmp_path)
    with pytest.raises(ClientFailure, match="refused before the first round"):
        strategy.start(grid, ArrayRecord(tiny_model().state_dict()), num_rounds=1)
    (failure,) = read_records(strategy.run_dir, "failure")
    assert failure["round"] == 0 and "--node-config 'partition-id=I num-partitions=N'" in failure["reason"]
    assert read_status(strategy.run_dir)["status"] == "failed"


def test_the_example_is_its_own_flower_app():
    """Its pyproject names its own components, and no federation: Flower 1.42 keeps those in
    $FLWR_HOME/config.toml and rewrites a pyproject that has one."""
    text = (EXAMPLE / "pyproject.toml").read_text()
    assert 'serverapp = "flower_fedavgm.server_app:app"' in text and 'clientapp = "flower_fedavgm.client_app:app"' in text
    assert "tool.flwr.federations" not in text
    assert "FedAvgM(" in (EXAMPLE / "flower_fedavgm" / "server_app.py").read_text()
