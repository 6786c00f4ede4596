"""The ``fedmech`` CLI (validate, plot, exit codes) and the plug-in import boundary."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from conftest import REPO
from fedmech_flwr.cli import EXIT_BAD_INPUT, EXIT_OK, main

PLUGIN_PACKAGES = ("clients", "strategies", "diagnostics")


# --- validate ---------------------------------------------------------------------------

def test_validate_ok(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml"]) == EXIT_OK == 0
    out, err = capsys.readouterr()
    assert out.startswith("OK: experiments/smoke.yaml: 'smoke': synthetic / dirichlet, simple_cnn, ")
    assert "3 clients x 2 rounds, strategy fedavg, client plain, pruning magnitude" in out
    assert err == ""


def test_validate_with_override(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml", "--set", "federation.num_rounds=9",
                 "--set", "pruning.mode=dense"]) == 0
    assert "3 clients x 9 rounds" in capsys.readouterr().out


def test_validate_bad_value_exits_2_with_message(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["validate", "experiments/smoke.yaml", "--set", "data.partition.alpha=-1"]) == EXIT_BAD_INPUT == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: alpha must be > 0, got -1")
    assert "experiments/smoke.yaml: data.partition.alpha" in err


def test_validate_malformed_override_and_missing_file(capsys, tmp_path):
    assert main(["validate", str(REPO / "experiments" / "smoke.yaml"), "--set", "seed"]) == 2
    assert "expected key=value, got 'seed'" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "experiment file not found" in capsys.readouterr().err


# --- plot -------------------------------------------------------------------------------

def test_plot_regenerates_deleted_plots(smoke_run, tmp_path, capsys):
    run = Path(shutil.copytree(smoke_run, tmp_path / "run"))
    before = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert "accuracy.png" in before and "weight_divergence_support_iou.png" in before
    shutil.rmtree(run / "plots")
    assert main(["plot", str(run)]) == 0
    after = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert after == before
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == before
    for name in after:
        assert (run / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_plot_of_a_non_run_folder_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert f"is {tmp_path} a fedmech run folder?" in capsys.readouterr().err


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


# --- plug-in boundary -------------------------------------------------------------------

def imported_top_levels(path: Path) -> set[str]:
    """Top-level package names a module imports (absolute imports only)."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_never_imports_plugins():
    core = sorted((REPO / "fedmech_flwr").rglob("*.py"))
    assert len(core) > 15 and REPO / "fedmech_flwr" / "plugins.py" in core
    offenders = {
        str(path.relative_to(REPO)): sorted(imported_top_levels(path) & set(PLUGIN_PACKAGES))
        for path in core
        if path.name != "plugins.py" or path.parent.name != "fedmech_flwr"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_composition_root_names_every_plugin_package():
    from fedmech_flwr import plugins

    assert plugins.PLUGIN_PACKAGES == PLUGIN_PACKAGES
    for package in PLUGIN_PACKAGES:
        assert (REPO / package / "__init__.py").is_file()


@pytest.mark.parametrize("package", PLUGIN_PACKAGES)
def test_plugin_packages_import_only_the_core(package):
    others = set(PLUGIN_PACKAGES) - {package}
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    uses_core = False
    for path in files:
        imported = imported_top_levels(path)
        assert not imported & others, f"{path.relative_to(REPO)} imports {sorted(imported & others)}"
        uses_core |= "fedmech_flwr" in imported
    assert uses_core  # plug-ins register through the core's registries


def test_boundary_check_detects_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy as np\nfrom strategies.fedavg import fedavg\nfrom . import x\n")
    assert imported_top_levels(bad) == {"numpy", "strategies"}


# --- fedmech run: the run config handed to ``flwr run --run-config`` --------------------

def test_run_config_survives_flowers_run_config_parser():
    import json

    from flwr.common.config import parse_config_args

    from fedmech_flwr.launch import _quote

    run_config = {
        "experiment": "/some dir/exp.yaml",
        "overrides": json.dumps(["federation.num_rounds=2", "name=it's \"q\"", "data.dataset.root=C:\\x"]),
        "out": "/tmp/out",
        "run-dir": "",
    }
    text = " ".join(f"{k}={_quote(v)}" for k, v in run_config.items())
    assert parse_config_args([text]) == run_config
    assert json.loads(parse_config_args([text])["overrides"])[1] == "name=it's \"q\""
