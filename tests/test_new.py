"""``fedmech new``: the plug-in, test and experiment it writes for each kind; the written
tests pass under pytest, each written experiment completes an in-process smoke run, and
a bad name or an existing file exits 2 writing nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.artifacts.folder import read_records, read_status
from fedmech_flwr.contracts.hooks import DIAGNOSTICS
from fedmech_flwr.spec.experiment import load_experiment
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, EXIT_OK, NEW_KINDS, main


def written(capsys, kind: str, name: str, folder) -> list[str]:
    assert main(["new", kind, name, "--dir", str(folder)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f"Wrote {folder / name}.py, {folder}/test_{name}.py, {folder / name}.yaml\n")
    return sorted(p.name for p in folder.iterdir())


def test_the_written_tests_pass(tmp_path, capsys):
    folder = tmp_path / "lab"
    for kind in NEW_KINDS:
        written(capsys, kind, f"lab_{kind}", folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "8 passed" in done.stdout, done.stdout[-3000:]  # a known answer and the contract
    # check of each kind; the model's contract at 2 shapes


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_the_written_experiment_completes_a_smoke_run_with_the_plugin(plugin_site, tmp_path, capsys, kind):
    name = f"lab_{kind}"
    assert written(capsys, kind, name, plugin_site) == [f"{name}.py", f"{name}.yaml", f"test_{name}.py"]
    cfg = load_experiment(plugin_site / f"{name}.yaml")
    assert cfg.plugins == [name] and cfg.name == name
    chosen = {"strategy": cfg.strategy.name, "client": cfg.client.name, "model": cfg.model.name,
              "diagnostic": cfg.diagnostics[0].name}
    assert chosen[kind] == name
    run = run_in_process(cfg, tmp_path / "runs")
    assert read_status(run)["status"] == "completed"
    if kind == "diagnostic":
        assert [r["global_norm"] > 0 for r in read_records(run, "diagnostic")] == [True, True]
        assert list(DIAGNOSTICS.get(name).outputs.metrics) == ["global_norm"]  # declared: every view shows it


@pytest.mark.parametrize(("kind", "name", "message"), [
    ("strategy", "2fast", "'2fast' is not a plug-in name: use a lowercase Python identifier such as my_median"),
    ("client", "MyClient", "'MyClient' is not a plug-in name"),
    ("model", "class", "'class' is not a plug-in name"),
    ("strategy", "fedavg", "strategy 'fedavg' is already registered by fedmech_flwr.builtin.strategies.fedavg "
                           "(built-in); pick another name"),
    ("diagnostic", "json", "a module 'json' already exists ("),
])
def test_a_bad_name_exits_2_writing_nothing(tmp_path, capsys, kind, name, message):
    assert main(["new", kind, name, "--dir", str(tmp_path / "lab")]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {message}") and err.rstrip().endswith(" in fedmech new"), err
    assert not (tmp_path / "lab").exists()


def test_an_existing_file_exits_2_and_is_kept(tmp_path, capsys):
    (tmp_path / "test_lab_median.py").write_text("mine\n")
    assert main(["new", "strategy", "lab_median", "--dir", str(tmp_path)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (f"error: {tmp_path}/test_lab_median.py already exist(s); fedmech new never "
                                       "overwrites: move them, or choose another name or --dir in fedmech new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_lab_median.py"]
    assert (tmp_path / "test_lab_median.py").read_text() == "mine\n"


@pytest.mark.integration
def test_a_written_model_runs_with_fedmech_run_on_the_server_and_the_ray_workers(tmp_path, capsys):
    """The next step ``fedmech new`` prints: with its folder on PYTHONPATH, ``fedmech run``
    of the written experiment completes (a model is built on both sides)."""
    folder = tmp_path / "lab"
    written(capsys, "model", "lab_mlp", folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(folder / "lab_mlp.yaml"),
           "--out", str(tmp_path / "out"), "--set", "federation.num_clients=2", "--set", "federation.num_rounds=1"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run,) = list((tmp_path / "out").iterdir())
    assert read_status(run)["status"] == "completed"
    assert sorted(r["partition_id"] for r in read_records(run, "client")) == [0, 1]
    assert set(read_records(run, "eval")[-1]["layer_sparsity"]) == {"fc1.weight", "head.weight"}  # the written model
