"""The public face for plug-ins (``fedmech_flwr.api``), the built-in plug-ins' names that
cannot collide with a user's, and the old public paths, kept for one release with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from string import Template

import pytest

from conftest import REPO
from fedmech_flwr import api, plugins
from fedmech_flwr.errors import ConfigError
from fedmech_flwr.tools.new_plugin import MODULES, TESTS

BUILTIN_FOLDERS = ("clients", "strategies", "diagnostics")


def api_names_imported(source: str) -> set[str]:
    """The names a module imports from ``fedmech_flwr.api``."""
    return {alias.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module == "fedmech_flwr.api" for alias in node.names}


def test_every_public_name_resolves_once():
    assert len(api.__all__) == len(set(api.__all__))
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []


def test_the_figures_are_imported_on_first_use():
    from fedmech_flwr import plotting

    assert api.line_plot is plotting.line_plot and api.heatmap is plotting.heatmap
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        api.nothing  # noqa: B018


def test_what_the_builtin_plugins_and_the_templates_import_is_public():
    sources = [p.read_text() for name in BUILTIN_FOLDERS for p in (REPO / name).rglob("*.py")]
    used = set().union(*map(api_names_imported, sources))
    assert {"WeightedFedAvg", "Diagnostic", "FedMechClient", "Outputs", "seed_for"} <= used
    assert used - set(api.__all__) == set()
    for kind in MODULES:
        for template in (MODULES[kind], TESTS[kind]):
            text = Template(template).substitute(name="lab_x", cls="LabX")
            names = api_names_imported(text)
            assert names and names <= set(api.__all__), kind
            assert set(re.findall(r"^\s*(?:from|import) (fedmech_flwr[\w.]*)", text, re.M)) == {"fedmech_flwr.api"}


def test_the_diagnostic_template_declares_what_it_records():
    assert "outputs=OUTPUTS" in MODULES["diagnostic"] and '"global_norm": Metric(' in MODULES["diagnostic"]


def test_register_picks_the_registry_by_kind_and_records_the_caller(monkeypatch):
    from fedmech_flwr.config import plugin_registries

    strategies = plugin_registries()["strategy"]
    monkeypatch.setattr(strategies, "_entries", dict(strategies._entries))

    @api.register("strategy", "api_registered", api.FedAvgConfig)
    def api_registered(params, ctx):
        return api.WeightedFedAvg(weighting=params.weighting, **api.OFFERED_NODES_ONLY)

    entry = api.STRATEGIES.get("api_registered")
    assert entry.factory is api_registered and entry.config_cls is api.FedAvgConfig and entry.module == __name__
    with pytest.raises(ConfigError, match="unknown plug-in kind 'strategies'; choose one of: dataset, partition"):
        api.register("strategies", "x")


# --- the built-in packages' names -----------------------------------------------------------

TRAPS = ("tests", "benchmarks", "examples", "scripts", "fedmech_flwr", "fedmech_flwr.registry")
"""Folders at the top of the repository beside the built-in packages, a second copy of the
core (with registries of its own) among them."""


@pytest.mark.parametrize("name", TRAPS)
def test_only_the_builtin_packages_import_under_fedmech_flwr_builtin(name):
    with pytest.raises(ModuleNotFoundError, match=f"^No module named 'fedmech_flwr\\.builtin\\."):
        importlib.import_module(f"fedmech_flwr.builtin.{name}")


def test_the_builtin_packages_import_from_their_folders_and_register_once():
    """Each from its folder at the top of the repository, its subpackages from theirs, every
    plug-in registered in the one registry of the one core."""
    plugins.load()
    plugins.load()  # idempotent: a second load registers nothing twice
    for name in (*BUILTIN_FOLDERS, "diagnostics.circuits", "diagnostics.usae"):
        package = importlib.import_module(f"fedmech_flwr.builtin.{name}")
        assert Path(package.__file__) == REPO.joinpath(*name.split("."), "__init__.py")
    fedavg = importlib.import_module("fedmech_flwr.builtin.strategies.fedavg")
    assert fedavg.STRATEGIES is api.STRATEGIES
    assert api.STRATEGIES.get("fedavg").module == "fedmech_flwr.builtin.strategies.fedavg"
    assert {m.split(".")[2] for m in sys.modules if m.startswith("fedmech_flwr.builtin.")} == set(BUILTIN_FOLDERS)


def test_a_missing_builtin_folder_is_named_with_what_to_do():
    code = ("from pathlib import Path; import fedmech_flwr.builtin as b; b.HOME = Path('/nowhere'); "
            "import fedmech_flwr.builtin.clients")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines()[-1] == (
        "ModuleNotFoundError: the built-in plug-in package fedmech_flwr.builtin.clients has no folder "
        "/nowhere/clients: reinstall fedmech (pip install -e . in a checkout)")


# --- old paths, for one release ------------------------------------------------------------

def test_the_old_flower_app_path_imports_with_a_warning_naming_the_new_one(monkeypatch):
    """An app written against ``fedmech_flwr.flower`` (the path before the restructuring)."""
    from fedmech_flwr.app import flower

    monkeypatch.delitem(sys.modules, "fedmech_flwr.flower", raising=False)
    with pytest.warns(DeprecationWarning, match=r"^fedmech_flwr\.flower is deprecated and goes in the next release: "
                                                r"import fedmech_flwr\.app\.flower instead$") as caught:
        old = importlib.import_module("fedmech_flwr.flower")
    ours = next(w for w in caught if str(w.message).startswith("fedmech_flwr.flower is deprecated"))
    assert ours.filename == __file__  # the warning points at the importer
    assert old.WithDiagnostics is flower.WithDiagnostics and old.attach_diagnostics is flower.attach_diagnostics
    assert old.strategy_record is flower.strategy_record  # a helper outside __all__ too
    assert old.__all__ == flower.__all__


def test_a_plugin_importing_an_internal_module_gets_one_visible_line_naming_the_api(tmp_path, monkeypatch, caplog):
    """A plug-in whose source imports core modules other than the api (as `fedmech new`
    wrote them before) is told once, by a log line that no warning filter hides; one that
    imports only fedmech_flwr.api is told nothing."""
    import logging

    (tmp_path / "lab_internal.py").write_text("import fedmech_flwr.hooks\nfrom fedmech_flwr import strategy\n"
                                              "from fedmech_flwr.api import STRATEGIES\n")
    (tmp_path / "lab_public.py").write_text("from fedmech_flwr.api import STRATEGIES\nimport fedmech_flwr.api\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedmech_flwr.plugins"):
        for _ in range(2):
            plugins.import_plugin("lab_internal", "x.yaml: plugins[0]")
            plugins.import_plugin("lab_public", "x.yaml: plugins[1]")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["plug-in lab_internal imports fedmech_flwr.hooks, fedmech_flwr.strategy: internal modules, which "
                    "change without notice; import what it needs from fedmech_flwr.api instead (its __all__ lists "
                    "every name a plug-in may use)"]
    for name in ("lab_internal", "lab_public"):
        del sys.modules[name]  # imported here only: gone with its folder
