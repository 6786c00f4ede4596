"""Plug-ins from their own package: an experiment's ``plugins:`` list and the
``fedmech.plugins`` entry points, the origin each entry records, and the errors that
name the key, the module and the distribution. The plug-in package ``lab16`` is written
into tmp_path, outside the repo; one real ``fedmech run`` uses it in the server and the
Ray workers."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from conftest import REPO, SMOKE
from fedmech_flwr.app import client_app
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.contracts import plugins
from fedmech_flwr.spec.experiment import load_experiment
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, EXIT_OK, main

LAB = "lab16"
STRATEGY = '''"""FedAvg that also reports a metric of its own, and declares it."""
from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, FedAvgConfig, WeightedFedAvg


class LabFedAvg(WeightedFedAvg):
    def average(self, server_round, contents, models, weights):
        arrays, _ = super().average(server_round, contents, models, weights)
        return arrays, {"lab-strategy": 16}


@STRATEGIES.register("lab_fedavg", FedAvgConfig, outputs=Outputs("Lab strategy", {
    "lab_strategy": Metric("lab mark", ("lab_strategy",), "marks", 0),
}, curves=("lab_strategy",), headline=("lab_strategy",)))
def lab_fedavg(params, ctx):
    return LabFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)
'''
CLIENT = '''"""Plain training that tags its metrics: the run's client records show it ran on the clients."""
from fedmech_flwr.api.client import CLIENTS, FedMechClient


@CLIENTS.register("lab_tagged")
class TaggedClient(FedMechClient):
    def fit(self, parameters, config):
        weights, num_examples, metrics = super().fit(parameters, config)
        return weights, num_examples, {**metrics, "lab-client": 16}
'''
GEOMETRY = '''"""The global weights' norm and the cosine between the clients' updates, declared."""
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult


@dataclass
class GeometryConfig:
    pass


def flat(arrays):
    return np.concatenate([v.ravel() for v in arrays.values()]).astype(np.float64)


@DIAGNOSTICS.register("lab_geometry", GeometryConfig, outputs=Outputs("Update geometry", {
    "weight_norm": Metric("global weight norm", ("weight_norm",), "L2", 2),
    "cosine": Metric("cosine between client updates", ("cosine",), "cosine", 3, better="higher",
                     flag=lambda r: "one client" if r["clients"] < 2 else None),
}, curves=("weight_norm", "cosine"), headline=("cosine",)))
class Geometry(Diagnostic):
    def server_side(self, state):
        start = flat(state.previous_global_arrays)
        steps = [flat(u.arrays) - start for u in state.clients.values()]
        cosines = [a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in combinations(steps, 2)]
        return DiagnosticResult({"weight_norm": float(np.linalg.norm(flat(state.global_arrays))),
                                 "cosine": float(np.mean(cosines)) if cosines else None, "clients": len(steps)})
'''
MODULES = {
    "strategy": STRATEGY,
    "geometry": GEOMETRY,
    "client": CLIENT,
    "again": STRATEGY.replace("class LabFedAvg", "class AgainFedAvg").replace("LabFedAvg(", "AgainFedAvg("),
    "dup": 'from fedmech_flwr.api.strategy import STRATEGIES\n\nSTRATEGIES.register("fedavg")(lambda params, ctx: None)\n',
    "broken": 'raise RuntimeError("the lab is closed")\n',
}
ENTRY = "entry point 'tagged' of lab16 0.1"


def write_lab(site: Path, entry_points: dict[str, str] | None = None) -> None:
    """The package ``lab16`` in ``site``; with ``entry_points``, the distribution ``lab16 0.1``
    that declares them in the group ``fedmech.plugins``."""
    (site / LAB).mkdir(parents=True)
    (site / LAB / "__init__.py").write_text("")
    for name, text in MODULES.items():
        (site / LAB / f"{name}.py").write_text(text)
    if entry_points:
        info = site / "lab16-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab16\nVersion: 0.1\n")
        lines = [f"{name} = {module}" for name, module in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join([f"[{plugins.ENTRY_POINT_GROUP}]", *lines]) + "\n")


def experiment(tmp_path: Path, **changes) -> Path:
    """The smoke experiment with ``changes`` to its top-level keys, as a file."""
    raw = {**yaml.safe_load(SMOKE.read_text()), **changes}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def listed_title(capsys, kind: str, name: str, *args: str) -> str:
    assert main(["list", kind, *args]) == EXIT_OK
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"  {name}  "))


# --- plugins: in the experiment ------------------------------------------------------------

def test_plugins_key_imports_before_validation_and_records_the_key(plugin_site, tmp_path, capsys):
    write_lab(plugin_site)
    exp = experiment(tmp_path, plugins=[f"{LAB}.strategy"], strategy={"name": "lab_fedavg", "weighting": "uniform"})
    assert main(["validate", str(exp)]) == EXIT_OK
    assert "strategy lab_fedavg" in capsys.readouterr().out
    assert listed_title(capsys, "strategies", "lab_fedavg") == f"  lab_fedavg  from lab16.strategy ({exp}: plugins[0])"
    assert load_experiment(exp).plugins == ["lab16.strategy"]  # saved with the resolved config, sent to clients


def test_list_imports_a_plugin_module_given_on_the_command_line(plugin_site, capsys):
    write_lab(plugin_site)
    title = listed_title(capsys, "clients", "lab_tagged", "--plugin", f"{LAB}.client")
    assert title == "  lab_tagged  (no parameters)  from lab16.client (--plugin)"


NOT_FOUND = f"; to make it importable, {plugins.MAKE_IMPORTABLE}"


@pytest.mark.parametrize(("module", "message"), [
    ("lab16.absent", "cannot import plug-in module 'lab16.absent': ModuleNotFoundError: No module named "
                     f"'lab16.absent'{NOT_FOUND}"),
    ("nolab.fed", f"cannot import plug-in module 'nolab.fed': ModuleNotFoundError: No module named 'nolab'{NOT_FOUND}"),
    ("lab16.broken", "cannot import plug-in module 'lab16.broken': RuntimeError: the lab is closed; it was found, "
                     "but importing it raised this: fix it"),
    ("lab16/broken.py", "expected a module name such as my_lab.fed.median, got 'lab16/broken.py'"),
])
def test_a_plugin_that_cannot_be_imported_exits_2_naming_key_module_and_error(plugin_site, tmp_path, capsys,
                                                                             monkeypatch, module, message):
    import fedmech_flwr.tools.cli as cli

    write_lab(plugin_site)
    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail("fedmech run started Flower for a bad plug-in"))
    exp = experiment(tmp_path, plugins=[f"{LAB}.client", module])
    for command in (["validate", str(exp)], ["run", str(exp), "--out", str(tmp_path / "out")]):
        assert main(command) == EXIT_BAD_INPUT
        assert capsys.readouterr() == ("", f"error: {message} in {exp}: plugins[1]\n")
    assert not (tmp_path / "out").exists()


def test_a_name_registered_twice_exits_2_naming_both_origins(plugin_site, tmp_path, capsys):
    write_lab(plugin_site)
    assert main(["validate", str(experiment(tmp_path, plugins=[f"{LAB}.dup"]))]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "error: strategy 'fedavg' is already registered by fedmech_flwr.builtin.strategies.fedavg (built-in); "
        f"lab16.dup ({tmp_path / 'exp.yaml'}: plugins[0]) registers it again: rename one of them\n")


# --- entry points ------------------------------------------------------------------------

def test_an_entry_point_plugin_is_loaded_at_start_and_listed_with_its_distribution(plugin_site, tmp_path, capsys):
    write_lab(plugin_site, {"tagged": f"{LAB}.client"})
    title = listed_title(capsys, "clients", "lab_tagged")
    assert title == f"  lab_tagged  (no parameters)  from lab16.client ({ENTRY})"
    assert main(["validate", str(experiment(tmp_path, client={"name": "lab_tagged"}))]) == EXIT_OK


def test_a_broken_entry_point_exits_2_naming_it_its_distribution_and_module(plugin_site, tmp_path, capsys):
    write_lab(plugin_site, {"gone": f"{LAB}.gone"})
    for command in (["list"], ["validate", str(SMOKE)]):
        assert main(command) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("error: the fedmech.plugins entry point 'gone' of lab16 0.1 cannot load module "
                              "'lab16.gone': ModuleNotFoundError: No module named 'lab16.gone'; "), err
        assert err.rstrip().endswith("; or uninstall lab16 0.1")


def test_a_name_an_entry_point_registered_first_names_its_distribution(plugin_site, tmp_path, capsys):
    write_lab(plugin_site, {"median": f"{LAB}.strategy"})
    assert main(["validate", str(experiment(tmp_path, plugins=[f"{LAB}.again"]))]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "error: strategy 'lab_fedavg' is already registered by lab16.strategy (entry point 'median' of lab16 0.1); "
        f"lab16.again ({tmp_path / 'exp.yaml'}: plugins[0]) registers it again: rename one of them\n")


# --- sweeps ------------------------------------------------------------------------------

def test_a_sweep_honours_its_base_experiments_plugins(plugin_site, tmp_path, capsys):
    write_lab(plugin_site)
    base = experiment(tmp_path, plugins=[f"{LAB}.client"], client={"name": "lab_tagged"})
    sweep = tmp_path / "grid.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(base), "grid": {"train.epochs": [1, 2]}}))
    assert main(["sweep", str(sweep), "--dry-run", "--out", str(tmp_path / "out")]) == EXIT_OK
    assert "2 cells, each validated" in capsys.readouterr().out
    experiment(tmp_path, plugins=[f"{LAB}.absent"])
    assert main(["sweep", str(sweep), "--dry-run"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "cannot import plug-in module 'lab16.absent'" in err and err.rstrip().endswith(f" in {base}: plugins[0]")


# --- a plug-in that fails ------------------------------------------------------------------

BROKEN_DIAGNOSTIC = '''from dataclasses import dataclass

from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic


@dataclass
class RatioConfig:
    pass


@DIAGNOSTICS.register("lab_ratio", RatioConfig)
class Ratio(Diagnostic):
    def server_side(self, state):
        return 1 / 0
'''


def test_a_failing_plugin_is_named_with_its_round_and_line_in_one_line(plugin_site, tmp_path):
    """status.json says where the run failed: the round, the plug-in module and file:line,
    the error; and that resuming can help once the plug-in is fixed."""
    (plugin_site / LAB).mkdir()
    (plugin_site / LAB / "__init__.py").write_text("")
    (plugin_site / LAB / "ratio.py").write_text(BROKEN_DIAGNOSTIC)
    cfg = load_experiment(experiment(tmp_path, plugins=[f"{LAB}.ratio"], diagnostics=[{"name": "lab_ratio"}]))
    with pytest.raises(ZeroDivisionError):
        run_in_process(cfg, tmp_path / "out")
    (run,) = (tmp_path / "out").iterdir()
    status = read_status(run)
    where = f"{plugin_site / LAB / 'ratio.py'}:14"  # the line of 1 / 0
    assert status["error"] == f"round 1, in {LAB}.ratio ({where}): ZeroDivisionError: division by zero"
    assert (status["status"], status["resumable"]) == ("failed", True)


# --- a node that lacks a plug-in -------------------------------------------------------------

def lacking_on(partition: int, module: str) -> ClientApp:
    """The real ClientApp, except that node ``partition`` cannot import ``module``, as a
    SuperNode where it is not installed."""
    app = ClientApp()

    @app.query(client_app.IDENTIFY_ACTION)
    def identify(msg: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) != partition:
            return client_app.identify(msg, context)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # its import fails, as where it is missing
            patch.setattr(client_app, "_CONFIGS", {})
            return client_app.identify(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client_app.train(msg, context)

    return app


def test_a_node_lacking_a_plugin_refuses_and_the_server_records_why(plugin_site, tmp_path, caplog):
    write_lab(plugin_site)
    exp = experiment(tmp_path, plugins=[f"{LAB}.strategy"], strategy={"name": "lab_fedavg"},
                     federation={"num_clients": 3, "num_rounds": 1, "on_client_failure": "continue"}, diagnostics=[])
    with caplog.at_level(logging.ERROR, logger="fedmech_flwr.app.client_app"):
        run = run_in_process(load_experiment(exp), tmp_path / "runs", client_app=lacking_on(1, f"{LAB}.strategy"))
    missing = "cannot import plug-in module 'lab16.strategy': ModuleNotFoundError: import of lab16.strategy halted"
    assert f"node 'node-1001' refuses to take part: {missing}" in caplog.text
    assert "install the package that provides it in this Python environment" in caplog.text
    assert read_status(run)["status"] == "completed"
    (failure,) = read_records(run, "failure")
    assert failure["round"] == 0 and failure["node"] == 1001
    assert failure["reason"].startswith(f"raised: ConfigError: node 'node-1001': {missing}")
    assert sorted(r["partition_id"] for r in read_records(run, "client")) == [0, 2]


# --- a user's own clients, strategies and diagnostics packages ------------------------------

USERS_PACKAGES = {
    "clients": '''"""A user's own clients package, named as the built-in one's folder is."""
from fedmech_flwr.api.client import CLIENTS, FedMechClient


@CLIENTS.register("user_client")
class UserClient(FedMechClient):
    def fit(self, parameters, config):
        weights, num_examples, metrics = super().fit(parameters, config)
        return weights, num_examples, {**metrics, "user-client": 1}
''',
    "strategies": '''"""A user's own strategies package."""
from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, FedAvgConfig, WeightedFedAvg


@STRATEGIES.register("user_fedavg", FedAvgConfig)
def user_fedavg(params, ctx):
    return WeightedFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)
''',
    "diagnostics": '''"""A user's own diagnostics package."""
from fedmech_flwr.api import Metric, Outputs
from fedmech_flwr.api.diagnostic import DIAGNOSTICS, Diagnostic, DiagnosticResult


@DIAGNOSTICS.register("user_round", outputs=Outputs("User", {"user_round": Metric("round", ("user_round",), "", 0)}))
class UserRound(Diagnostic):
    def server_side(self, state):
        return DiagnosticResult({"user_round": state.server_round})
''',
}


def write_users_packages(site: Path) -> None:
    for name, text in USERS_PACKAGES.items():
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(text)


def users_experiment(tmp_path: Path) -> Path:
    """The smoke experiment with the user's packages' plug-ins beside built-in ones."""
    return experiment(tmp_path, plugins=["clients", "strategies", "diagnostics"], client={"name": "user_client"},
                      strategy={"name": "user_fedavg"}, federation={"num_clients": 3, "num_rounds": 1},
                      diagnostics=[{"name": "user_round"}, {"name": "weight_divergence"}])


def test_a_users_own_clients_strategies_and_diagnostics_packages_leave_the_builtins_registered(
        plugin_site, tmp_path, capsys):
    """A user's ``clients``, ``strategies`` and ``diagnostics`` packages on the path (an
    ordinary layout of a Flower project) neither hide the built-in plug-ins (they emptied
    the registry when the built-in ones were top-level packages of the same names) nor are
    hidden by them."""
    write_users_packages(plugin_site)
    assert main(["validate", str(SMOKE)]) == EXIT_OK
    assert "strategy fedavg, client plain" in capsys.readouterr().out
    assert main(["list", "strategies"]) == EXIT_OK
    assert "  fedavg  " in capsys.readouterr().out
    exp = users_experiment(tmp_path)
    assert main(["validate", str(exp)]) == EXIT_OK
    assert listed_title(capsys, "strategies", "user_fedavg") == f"  user_fedavg  from strategies ({exp}: plugins[1])"
    run = run_in_process(load_experiment(exp), tmp_path / "runs")
    assert read_status(run)["status"] == "completed"
    assert sorted(r["user_client"] for r in read_records(run, "client")) == [1, 1, 1]
    assert [r["user_round"] for r in read_records(run, "diagnostic") if "user_round" in r] == [1]


# --- one real run ------------------------------------------------------------------------

@pytest.mark.integration
def test_a_users_plugins_run_and_every_output_shows_what_they_declare(tmp_path):
    """A diagnostic and a strategy from a package outside the repository (``plugins:``),
    and a client from an entry point: one real ``fedmech run``, then a two-seed sweep.
    Only the directory on PYTHONPATH makes them importable, in the CLI, the ServerApp and
    every Ray worker. Their declared metrics reach the console's round line, the sweep's
    progress line, ``fedmech plot``'s files, and the report's table, curves, leaderboard
    and summary.json, with no core edit."""
    site = tmp_path / "site"
    site.mkdir()
    write_lab(site, {"tagged": f"{LAB}.client"})
    exp = experiment(tmp_path, plugins=[f"{LAB}.strategy", f"{LAB}.geometry"], client={"name": "lab_tagged"},
                     strategy={"name": "lab_fedavg", "weighting": "uniform"}, diagnostics=[{"name": "lab_geometry"}],
                     federation={"num_clients": 2, "num_rounds": 3})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    def fedmech(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout + done.stderr

    console = fedmech("run", str(exp), "--out", str(tmp_path / "out"))
    (run,) = list((tmp_path / "out").iterdir())
    assert read_status(run)["status"] == "completed"
    assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == ["lab16.strategy", "lab16.geometry"]
    assert sorted((r["partition_id"], r["lab_client"]) for r in read_records(run, "client") if r["round"] == 1) == \
        [(0, 16), (1, 16)]
    line = next(x for x in console.splitlines() if "round 3/3 |" in x)
    assert "| cosine between client updates " in line and "| lab mark 16 |" in line, line

    for plot in (run / "plots").iterdir():
        plot.unlink()
    drawn = fedmech("plot", str(run))
    assert "lab_geometry_cosine.png" in drawn and "strategy_lab_strategy.png" in drawn
    assert {"lab_geometry_weight_norm.png", "lab_geometry_cosine.png", "strategy_lab_strategy.png"} <= \
        {p.name for p in (run / "plots").iterdir()}

    sweep = tmp_path / "seeds.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(exp), "name": "lab", "seeds": [0, 1],
                                     "set": {"strategy.weighting": "examples"}}))
    progress = fedmech("sweep", str(sweep), "--out", str(tmp_path / "sweeps"))
    assert progress.count("| lab mark 16") == 2 and "cosine between client updates" in progress, progress
    cells = sorted((tmp_path / "sweeps" / "lab" / "runs").iterdir())
    fedmech("report", *map(str, cells), str(run), "--out", str(tmp_path / "report"))
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    sweep_group = next(g for g in summary["groups"] if g["completed"] == 2)
    assert sweep_group["stats"]["lab_geometry.cosine"]["n"] == 2
    assert sweep_group["stats"]["strategy.lab_strategy"]["mean"] == 16
    html = (tmp_path / "report" / "index.html").read_text()
    assert "<h2>Update geometry</h2>" in html and "<h2>Strategy metrics</h2>" in html and "lab mark" in html
    assert "plots/lab_geometry_cosine.png" in (tmp_path / "report" / "report.md").read_text()  # its curve, 3 rounds
    board = html[html.index("<h2>Strategy leaderboard</h2>"):]
    assert "lab_fedavg(examples) + lab_tagged" in board and "lab_fedavg(uniform) + lab_tagged" in board
    assert "cosine between client updates" in board and "lab mark" in board


@pytest.mark.integration
def test_a_real_run_from_a_folder_holding_a_users_own_clients_strategies_and_diagnostics(tmp_path):
    """``fedmech validate`` and a real 1-round ``fedmech run`` from the user's folder, its
    ``clients``, ``strategies`` and ``diagnostics`` packages on PYTHONPATH: the built-in
    plug-ins are all there in the CLI, the ServerApp and every Ray worker, and the user's
    packages are theirs (the app bundle holds the built-in folders under fedmech_flwr/)."""
    site = tmp_path / "site"
    site.mkdir()
    write_users_packages(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    def fedmech(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.cli", *args], cwd=site, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done.stdout + done.stderr

    assert "strategy fedavg, client plain" in fedmech("validate", str(SMOKE))
    fedmech("run", str(SMOKE), "--set", "federation.num_rounds=1", "--out", str(tmp_path / "smoke"))
    fedmech("run", str(users_experiment(tmp_path)), "--out", str(tmp_path / "users"))
    (smoke,), (users,) = (list((tmp_path / out).iterdir()) for out in ("smoke", "users"))
    assert read_status(smoke)["status"] == read_status(users)["status"] == "completed"
    assert sorted(r["user_client"] for r in read_records(users, "client")) == [1, 1, 1]
    assert [r["user_round"] for r in read_records(users, "diagnostic") if "user_round" in r] == [1]
