"""``fedmech sweep``: grid expansion against hand-written expectations, bad input that
starts nothing, what a rerun does with each cell, and whether the machine fits ``--parallel``.
The real sweeps (killed and continued) are in ``test_sweep_run.py``."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, as_killed
from fedmech_flwr.foundation.errors import ConfigError, RunFolderError
from fedmech_flwr.tools.cli import main
from fedmech_flwr.tools.sweep import auto_label, check_fits, headline, load_sweep, plan_action

SMOKE = str(REPO / "experiments" / "smoke.yaml")


def sweep_file(tmp_path: Path, **spec) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"base": SMOKE, **spec}, sort_keys=False))
    return path


GRID = {
    "name": "g",
    "seeds": [0, 1],
    "set": {"federation.num_rounds": 1},
    "grid": {
        "data.partition": {"iid": {"name": "iid"}, "a0.5": {"name": "dirichlet", "alpha": 0.5, "min_samples": 10}},
        "pruning.target_sparsity": [0.5, 0.9],
    },
    "zip": [{"strategy": [{"name": "fedavg"}, {"name": "fedprox", "proximal_mu": 0.1}],
             "client": [{"name": "plain"}, {"name": "proximal"}]}],
    "presets": {"tiny": {"set": {"train.epochs": 1}, "grid": {"pruning.target_sparsity": {"s8": 0.8}}, "seeds": [7]}},
}


# --- expansion --------------------------------------------------------------------------

def test_grid_is_the_product_of_axes_zip_moves_together_and_seeds_come_last(tmp_path):
    plan = load_sweep(sweep_file(tmp_path, **GRID))
    assert [a.name for a in plan.axes] == ["data.partition", "pruning.target_sparsity", "strategy+client"]
    assert [c.name for c in plan.cells][:4] == [
        "iid_target-sparsity0.5_fedavg-plain_s0", "iid_target-sparsity0.5_fedavg-plain_s1",
        "iid_target-sparsity0.5_fedprox-proximal-mu0.1-proximal_s0",
        "iid_target-sparsity0.5_fedprox-proximal-mu0.1-proximal_s1",
    ]
    assert len(plan.cells) == 2 * 2 * 2 * 2
    cell = plan.cells[-1]
    assert cell.name == "a0.5_target-sparsity0.9_fedprox-proximal-mu0.1-proximal_s1"
    assert cell.group == "a0.5_target-sparsity0.9_fedprox-proximal-mu0.1-proximal"
    assert cell.axes == {"data.partition": "a0.5", "pruning.target_sparsity": "target-sparsity0.9",
                         "strategy+client": "fedprox-proximal-mu0.1-proximal"}
    assert cell.overrides == [
        "federation.num_rounds=1", "data.partition={name: dirichlet, alpha: 0.5, min_samples: 10}",
        "pruning.target_sparsity=0.9", "strategy={name: fedprox, proximal_mu: 0.1}", "client={name: proximal}",
        "seed=1", "name=g-a0.5_target-sparsity0.9_fedprox-proximal-mu0.1-proximal_s1",
    ]
    cfg = cell.config
    assert (cfg.seed, cfg.federation.num_rounds, cfg.pruning.target_sparsity) == (1, 1, 0.9)
    assert (cfg.data.partition.name, cfg.data.partition.params.alpha) == ("dirichlet", 0.5)
    assert (cfg.strategy.name, cfg.strategy.params.proximal_mu, cfg.client.name) == ("fedprox", 0.1, "proximal")


def test_preset_overrides_set_replaces_an_axis_and_its_seeds(tmp_path):
    plan = load_sweep(sweep_file(tmp_path, **GRID), preset="tiny")
    assert plan.preset == "tiny" and plan.seeds == [7]
    assert [c.name for c in plan.cells] == [
        "iid_s8_fedavg-plain_s7", "iid_s8_fedprox-proximal-mu0.1-proximal_s7",
        "a0.5_s8_fedavg-plain_s7", "a0.5_s8_fedprox-proximal-mu0.1-proximal_s7",
    ]
    assert all(c.config.train.epochs == 1 and c.config.pruning.target_sparsity == 0.8 for c in plan.cells)
    assert plan.folder(tmp_path).name == "g-tiny"
    # --seeds beats the preset's seeds, and the file's
    assert load_sweep(sweep_file(tmp_path, **GRID), preset="tiny", seeds=[3, 4]).seeds == [3, 4]


def test_a_presets_zipped_group_replaces_the_one_setting_the_same_keys_in_its_place(tmp_path):
    """Labelled in another key order, it still replaces the file's strategy+client group,
    before the group that follows it, so that cell names keep their order."""
    spec = {"zip": [{"strategy": [{"name": "fedavg"}], "client": [{"name": "plain"}]},
                    {"federation.num_rounds": [1]}],
            "presets": {"prox": {"zip": [{"prox": {"client": {"name": "proximal"},
                                                   "strategy": {"name": "fedprox", "proximal_mu": 0.5}}}]}}}
    plan = load_sweep(sweep_file(tmp_path, **spec), preset="prox")
    assert [a.name for a in plan.axes] == ["client+strategy", "federation.num_rounds"]
    assert [c.name for c in plan.cells] == ["prox_num-rounds1_s0"]
    assert plan.cells[0].config.strategy.params.proximal_mu == 0.5


def test_labelled_zip_and_only(tmp_path):
    spec = {"zip": [{"fedavg": {"strategy": {"name": "fedavg"}, "client": {"name": "plain"}},
                     "prox": {"strategy": {"name": "fedprox"}, "client": {"name": "proximal"}}}],
            "grid": {"federation.num_rounds": [1, 2]}}
    plan = load_sweep(sweep_file(tmp_path, **spec), only={"strategy+client": ["prox"]})
    assert [c.name for c in plan.cells] == ["num-rounds1_prox_s0", "num-rounds2_prox_s0"]  # grid axes, then zip
    assert plan.folder(tmp_path) == tmp_path.resolve() / "grid"


def test_a_sweep_without_axes_is_one_group_of_seeds(tmp_path):
    plan = load_sweep(sweep_file(tmp_path, seeds=[0, 1, 2]))
    assert [(c.name, c.group) for c in plan.cells] == [("base_s0", "base"), ("base_s1", "base"), ("base_s2", "base")]


@pytest.mark.parametrize(("key", "value", "label"), [
    ("data.partition", {"name": "dirichlet", "alpha": 0.05}, "dirichlet-alpha0.05"),
    ("pruning.target_sparsity", 0.999, "target-sparsity0.999"),
    ("model", {"name": "simple_cnn", "channels": [32, 64]}, "simple-cnn-channels32-64"),
    ("pruning.mode", "dense", "dense"),
])
def test_auto_labels(key, value, label):
    assert auto_label(key, value) == label


# --- bad input: exit 2 naming the key, nothing started ----------------------------------

BAD = [
    ({"grid": {"federation.num_round": [1, 2]}}, [], "unknown key(s) ['num_round']", "cell num-round1_s0: federation"),
    ({"grid": {"federation.num_rounds": []}}, [], "an axis needs at least one value", "grid.federation.num_rounds"),
    ({"zip": [{"strategy": [{"name": "fedavg"}], "client": [{"name": "plain"}, {"name": "plain"}]}]}, [],
     "zipped axes must have the same length, got {'strategy': 1, 'client': 2}", "zip[0]"),
    ({"grid": {"federation.num_rounds": [0]}}, [], "num_rounds must be >= 1, got 0",
     "cell num-rounds0_s0: federation.num_rounds"),
    ({"presets": {"cpu": {}}}, ["--preset", "gpu"], "no preset 'gpu'; this file has ['cpu']", "--preset"),
    ({"grid": {"model": [{"name": "simple_cnn"}]}, "set": {"model.channels": [4]}}, [],
     "model.channels is set by the axis 'model'", "set.model.channels"),
    ({"zip": [{"a": {"strategy": {"name": "fedavg"}, "train.lr": 0.1}}], "set": {"train": {"lr": 0.01}}}, [],
     "train.lr is set by the axis 'strategy+train.lr'", "set.train.lr"),
    ({"zip": [{"strategy": [{"name": "fedavg"}], "client": [{"name": "plain"}]}],
      "presets": {"p": {"zip": [{"strategy": [{"name": "fedprox"}]}]}}}, ["--preset", "p"],
     "it sets ['strategy'], the axis 'strategy+client' sets ['client', 'strategy']; a preset's zipped group "
     "replaces the one that sets the same keys", "presets.p.zip[0]"),
    ({"grid": {"federation.num_rounds": [1, 1]}}, [], "values share the label(s) ['num-rounds1']",
     "grid.federation.num_rounds"),
    ({}, ["--parallel", "99"], "99 runs at once need 99 CPUs", "--parallel"),
    ({}, ["--only", "model=x"], "no axis 'model'", "--only"),
    ({"name": "-A1"}, [], "'-A1' names the sweep folder", "name"),
    ({"presets": {"-x": {}}}, [], "'-x' names the sweep folder", "presets.-x"),
]


@pytest.mark.parametrize(("spec", "args", "message", "where"), BAD)
def test_bad_sweep_exits_2_naming_the_key_and_starts_nothing(spec, args, message, where, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file(tmp_path, **spec)), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and where in err, err
    assert not out.exists()


def test_sweep_file_without_base_exits_2(tmp_path, capsys):
    path = tmp_path / "nobase.yaml"
    path.write_text("grid: {seed: [1]}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "missing required key 'base'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_base_that_is_no_experiment_is_named_and_none_of_it_quoted(tmp_path, capsys):
    """``base: /etc/passwd``: the error names the file and what it should be; the file's
    text, anyone's, stays out of it."""
    secret = tmp_path / "passwd"
    secret.write_text("".join(f"user{i}:x:{1000 + i}:{1000 + i}:secret-{i}:/home/user{i}:/bin/sh\n" for i in range(40)))
    path = sweep_file(tmp_path)
    path.write_text(f"base: {secret}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert message.startswith("expected an experiment or sweep file, a mapping of keys (name:, data:, ...), got text "
                              "of ") and message.endswith(f" in {secret}")
    assert not any(part in message for part in ("user", "secret-", "/bin/sh", "1000")), message
    assert main(["sweep", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_dry_run_lists_the_validated_cells(tmp_path, capsys):
    assert main(["sweep", str(sweep_file(tmp_path, **GRID)), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {tmp_path / 'grid.yaml'}: 16 cells, each validated")
    assert "  iid_target-sparsity0.5_fedavg-plain_s0: federation.num_rounds=1 data.partition={name: iid}" in out
    assert not (tmp_path / "out").exists()


# --- what a rerun does with each cell ------------------------------------------------------

def status(run: Path, value: str, pid: int | None = None) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("{}")
    (run / "status.json").write_text(json.dumps({"status": value, "pid": pid or os.getpid(),
                                                 "host": socket.gethostname()}))
    return run


def test_plan_action_per_cell_state(tmp_path):
    fresh = {"status": "pending"}
    assert plan_action(fresh, tmp_path / "none", False) == "start"
    partial = tmp_path / "partial"
    partial.mkdir()  # killed before the ServerApp wrote config.yaml
    assert plan_action(fresh, partial, False) == "start"
    assert plan_action({"status": "completed"}, status(tmp_path / "done", "completed"), True) == "skip"
    torn = status(tmp_path / "torn", "completed")  # its records end at round 1 of 2
    (torn / "config.yaml").write_text("federation: {num_rounds: 2}")
    (torn / "metrics.jsonl").write_text('{"kind": "eval", "round": 0}\n{"kind": "eval", "round": 1}\n')
    assert plan_action({"status": "completed"}, torn, False) == "resume"
    killed = status(tmp_path / "killed", "running")
    as_killed(killed)
    assert plan_action({"status": "running"}, killed, False) == "resume"
    interrupted = status(tmp_path / "interrupted", "failed")
    assert plan_action({"status": "interrupted"}, interrupted, False) == "resume"
    failed = status(tmp_path / "failed", "failed")
    assert plan_action({"status": "failed"}, failed, False) == "failed"
    assert plan_action({"status": "failed"}, failed, True) == "resume"
    assert plan_action({"status": "failed"}, tmp_path / "none", True) == "start"
    with pytest.raises(RunFolderError, match=f"still being written by process {os.getpid()}"):
        plan_action({"status": "running"}, status(tmp_path / "live", "running"), False)


def test_a_live_sweep_holds_its_folder(tmp_path, capsys):
    path = sweep_file(tmp_path, name="held")
    folder = tmp_path / "out" / "held"
    folder.mkdir(parents=True)
    (folder / "sweep.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "t"}))
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"{folder} is being run by process {os.getpid()}" in capsys.readouterr().err
    assert not (folder / "sweep.json").exists()


def test_a_folder_that_ran_other_settings_is_refused(tmp_path, capsys):
    gone = subprocess.Popen(["true"])
    gone.wait()
    path = sweep_file(tmp_path, name="changed")
    folder = tmp_path / "out" / "changed"
    folder.mkdir(parents=True)
    plan = load_sweep(path)
    config = plan.cells[0].config.to_plain()
    config["federation"]["num_rounds"] = 7
    (folder / "sweep.json").write_text(json.dumps({"cells": [{"name": "base_s0", "config": config}]}))
    (folder / "sweep.lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))  # stale
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "already ran cell base_s0 with other settings (federation.num_rounds)" in capsys.readouterr().err


# --- does the machine fit --parallel ------------------------------------------------------

def test_check_fits_cpus_and_memory(tmp_path):
    cells = load_sweep(sweep_file(tmp_path)).cells  # 3 clients, 1 CPU each
    assert check_fits(cells, 1, cpus=2, memory_gib=1.0) is None  # one at a time: as fedmech run
    assert check_fits(cells, 2, cpus=2, memory_gib=8.0) == 1  # each private Ray gets one CPU
    with pytest.raises(ConfigError, match="3 runs at once need 3 CPUs .* this machine has 2; use --parallel 2"):
        check_fits(cells, 3, cpus=2, memory_gib=64.0)
    with pytest.raises(ConfigError, match=r"need about 7.6 GiB \(1.9 GiB each: the server and 1 client actor"):
        check_fits(cells, 4, cpus=4, memory_gib=4.0)
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_fits(cells, 0)
    on_cluster = load_sweep(sweep_file(tmp_path, set={"simulation.ray_address": "auto"})).cells
    assert check_fits(on_cluster, 64, cpus=2, memory_gib=1.0) is None  # the cluster schedules them


@pytest.mark.parametrize("fraction, expected", [
    # predicts one class for every test image: the global model and the gap against it are flagged
    (1.0, "global test accuracy 10.0% ⚑ one class | probe 36.6% | probe − global +26.6 pp ⚑ one class"),
    (0.3, "global test accuracy 10.0% | probe 36.6% | probe − global +26.6 pp"),
])
def test_the_progress_line_flags_a_one_class_model(tmp_path, fraction, expected):
    records = [{"kind": "eval", "round": 3, "accuracy": 0.1, "max_predicted_fraction": fraction},
               {"kind": "diagnostic", "round": 3, "name": "misalignment", "global": {"max_predicted_fraction": fraction},
                "probe": {"accuracy": 0.366, "max_predicted_fraction": 0.2}, "gaps": {"probe": 0.266}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert headline(tmp_path) == expected


def test_a_stopped_sweep_names_the_exact_command_that_continues_it(tmp_path, capsys, monkeypatch):
    """``fedmech sweep FILE --seeds 0`` stopped: its line, sweep.json and ``fedmech status``
    name the command with --seeds 0 and the folder's --out, so a rerun continues these
    cells instead of growing the sweep to the file's seeds (``run the same command again``
    lost the flags)."""
    import fedmech_flwr.tools.sweep as sweep_module

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module, "_run_cells", stopped)
    path = sweep_file(tmp_path, **GRID)
    out = tmp_path / "out with space"
    assert main(["sweep", str(path), "--seeds", "0", "--only", "data.partition=iid", "--out", str(out)]) == 130
    command = shlex.join(["fedmech", "sweep", str(path), "--seeds", "0", "--only", "data.partition=iid",
                          "--out", str(out)])
    assert f"continue it with `{command}`" in capsys.readouterr().err
    folder = out / "g"
    assert json.loads((folder / "sweep.json").read_text())["command"] == command
    assert main(["status", str(folder)]) == 1
    assert f"  continue it: `{command}`" in capsys.readouterr().out
    assert shlex.split(command)[3:5] == ["--seeds", "0"]  # pasted back, the shell gives the same arguments
