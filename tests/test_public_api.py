"""The public face for plug-ins (``fedmech_flwr.api``), the built-in plug-ins' names that
cannot collide with a user's, and the old public paths, kept for one release with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import types
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

def test_the_builtin_plugins_install_under_fedmech_flwr():
    plugins.load()
    for name in BUILTIN_FOLDERS:
        package = sys.modules[f"fedmech_flwr.builtin.{name}"]
        assert Path(package.__file__) == REPO / name / "__init__.py"
    assert api.STRATEGIES.get("fedavg").module == "fedmech_flwr.builtin.strategies.fedavg"


def test_a_builtin_package_found_elsewhere_is_refused_naming_the_file(monkeypatch, tmp_path):
    """Another checkout's plug-ins would register their own versions under the built-in
    names; fedmech refuses to start, naming the file it found and the one it expected."""
    elsewhere = tmp_path / "old_checkout" / "strategies" / "__init__.py"
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_text("")
    impostor = types.ModuleType("fedmech_flwr.builtin.strategies")
    impostor.__file__ = str(elsewhere)
    monkeypatch.setitem(sys.modules, "fedmech_flwr.builtin.strategies", impostor)
    with pytest.raises(ConfigError) as err:
        plugins.load()
    assert str(err.value).startswith(f"the built-in plug-in package fedmech_flwr.builtin.strategies was imported from "
                                     f"{elsewhere}, but this fedmech ({REPO / 'fedmech_flwr'}) has it at "
                                     f"{REPO / 'strategies' / '__init__.py'}: ")
    assert str(err.value).endswith(" in fedmech_flwr.plugins")


# --- old paths, for one release ------------------------------------------------------------

def python(code: str, cwd: Path, *flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


OLD_TEMPLATE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from fedmech_flwr.strategy import STRATEGIES        # what `fedmech new strategy` wrote before
    from strategies.fedavg import FedAvgConfig, WeightedFedAvg
from fedmech_flwr import api, plugins
plugins.load()                                          # the built-in plug-ins once, under their new names
assert WeightedFedAvg is api.WeightedFedAvg and FedAvgConfig is api.FedAvgConfig
assert STRATEGIES.get("fedavg").module == "fedmech_flwr.builtin.strategies.fedavg"
for w in caught:
    if "next release" in str(w.message):
        print(w.category.__name__, w.filename == "<string>", w.message)
"""


@pytest.mark.parametrize("where", ["elsewhere", "the repository"])
def test_the_old_plugin_paths_import_with_a_warning_naming_the_new_one(tmp_path, where):
    """``from strategies.fedavg import WeightedFedAvg``, a user's subclass as ``fedmech new``
    wrote it before, still imports, warned about, and registers nothing twice, also from
    the repository's folder (where ``strategies/`` itself is on sys.path)."""
    done = python(OLD_TEMPLATE, tmp_path if where == "elsewhere" else REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "DeprecationWarning True strategies is deprecated and goes in the next release: import "
        "fedmech_flwr.builtin.strategies instead (a plug-in needs only fedmech_flwr.api)",
        "DeprecationWarning True strategies.fedavg is deprecated and goes in the next release: import "
        "fedmech_flwr.api instead (a plug-in needs only fedmech_flwr.api)"]


@pytest.mark.parametrize("cwd", ["its folder", "the repository"])
def test_a_users_own_package_of_an_old_name_is_imported_not_the_alias(tmp_path, cwd):
    """Also where the repository's root comes first on sys.path (its folder, the app bundle
    of ``flwr run .``), the user's ``strategies`` is imported, and the built-in plug-ins are
    all registered."""
    site = tmp_path / "site"
    (site / "strategies").mkdir(parents=True)
    (site / "strategies" / "__init__.py").write_text("MINE = True\n")
    code = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import fedmech_flwr.plugins as p, strategies
    p.load()
from fedmech_flwr.api import STRATEGIES
print(strategies.MINE, "fedavg" in STRATEGIES.names(), [str(w.message) for w in caught if "next release" in str(w.message)])
"""
    done = python(code, site if cwd == "its folder" else REPO, pythonpath=site)
    assert (done.returncode, done.stdout) == (0, "True True []\n"), done.stderr


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
