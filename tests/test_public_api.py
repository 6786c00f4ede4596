"""The public API for plug-ins (``fedmech_flwr.api`` and one module per role, each with its
own ``__all__``), the reference page that lists exactly those names, the names the api had
before it was split by role (kept for one release with a DeprecationWarning naming the new
place), the built-in plug-ins' names that cannot collide with a user's, and the old public
paths."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from string import Template

import pytest

from conftest import REPO
from fedmech_flwr import api
from fedmech_flwr.api import _builtin
from fedmech_flwr.contracts import plugins
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.tools import reference
from fedmech_flwr.tools.new_plugin import MODULES, TESTS

BUILTIN_FOLDERS = ("clients", "strategies", "diagnostics")
FACES = reference.api_modules()
"""``fedmech_flwr.api`` and its role modules."""


def public_names() -> dict[str, str]:
    """Every promised name -> the API module that holds it."""
    return {name: face for face in FACES for name in importlib.import_module(face).__all__}


def api_imports(source: str) -> dict[str, set[str]]:
    """The names a module imports from each ``fedmech_flwr.api`` module."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedmech_flwr.api"):
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return found


def docs_examples() -> list[str]:
    """The Python code blocks of the docs and the example apps' sources."""
    pages = [*(REPO / "docs").rglob("*.md"), REPO / "README.md"]
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    return blocks + [p.read_text() for p in (REPO / "examples").rglob("*.py")]


def test_each_name_is_promised_once_and_resolves():
    counted = [name for face in FACES for name in importlib.import_module(face).__all__]
    assert len(counted) == len(set(counted)) == len(public_names())
    for face in FACES:
        module = importlib.import_module(face)
        assert [name for name in module.__all__ if not hasattr(module, name)] == [], face
    assert len(counted) <= 50  # a small promise (the contract checks to come included): only what a user needs
    assert not set(_builtin.__all__) & set(counted)


def test_the_figures_are_imported_on_first_use():
    from fedmech_flwr.artifacts import plotting
    from fedmech_flwr.api import diagnostic

    assert diagnostic.line_plot is plotting.line_plot and diagnostic.heatmap is plotting.heatmap
    assert _builtin.class_labels is plotting.class_labels
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        diagnostic.nothing  # noqa: B018


def test_the_builtins_import_each_name_from_its_one_home():
    """A built-in imports a promised name from the API module that holds it, and anything
    else only from the private ``_builtin``; nothing from the api's deprecated names."""
    home = public_names()
    wrong = []
    for path in (p for name in BUILTIN_FOLDERS for p in (REPO / name).rglob("*.py")):
        for module, names in api_imports(path.read_text()).items():
            allowed = set(_builtin.__all__) if module == _builtin.__name__ else {n for n in names if home.get(n) == module}
            wrong += [f"{path.relative_to(REPO)}: {name} from {module}" for name in sorted(names - allowed)]
    assert wrong == []


def test_templates_docs_and_examples_import_only_the_public_api():
    """What a user copies (``fedmech new``'s files, the docs' code, the example apps) imports
    each name from its public home, and never the private module."""
    home = public_names()
    texts = [Template(t).substitute(name="lab_x", cls="LabX") for kind in MODULES for t in (MODULES[kind], TESTS[kind])]
    used = {}
    for text in [*texts, *docs_examples()]:
        for module, names in api_imports(text).items():
            used.setdefault(module, set()).update(names)
    assert _builtin.__name__ not in used
    assert {f"{module}: {name}" for module, names in used.items() for name in names if home.get(name) != module} == set()
    assert {"fedmech_flwr.api.strategy", "fedmech_flwr.api.client", "fedmech_flwr.api.diagnostic",
            "fedmech_flwr.api.model"} <= set(used)
    for text in texts:
        assert {m.split(".")[0] + "." + m.split(".")[1] for m in re.findall(r"^\s*(?:from|import) (fedmech_flwr[\w.]*)",
                                                                          text, re.M)} == {"fedmech_flwr.api"}


def test_the_reference_page_lists_exactly_each_modules_all():
    text = (reference.REFERENCE_DIR / "api.md").read_text()
    assert reference.api_page_names(text) == {face: list(importlib.import_module(face).__all__) for face in FACES}
    assert text == reference.api_page()


def test_every_public_function_and_main_entry_has_a_numpydoc_docstring():
    """Parameters, Returns and an Examples section, written where the function is defined:
    every public function, ``Registry.register`` (the one way every role registers) and the
    method each role's base class is subclassed for."""
    from fedmech_flwr.api.client import FedMechClient
    from fedmech_flwr.api.diagnostic import Diagnostic
    from fedmech_flwr.api.model import FedMechModel
    from fedmech_flwr.api.strategy import WeightedFedAvg
    from fedmech_flwr.foundation.registry import Registry

    functions = {name: value for face in FACES for name in importlib.import_module(face).__all__
                 if inspect.isfunction(value := getattr(importlib.import_module(face), name))}
    for method in (Registry.register, FedMechClient.loss, FedMechClient.objective, WeightedFedAvg.average,
                   Diagnostic.server_side, Diagnostic.client_side, FedMechModel.forward_features):
        functions[method.__qualname__] = method
    missing = [f"{name}: {section}" for name, fn in functions.items()
               for section in ("Parameters\n----------", "Returns\n-------", "Examples\n--------")
               if section not in inspect.getdoc(fn)]
    assert missing == []


def test_the_diagnostic_template_declares_what_it_records():
    assert "outputs=OUTPUTS" in MODULES["diagnostic"] and '"global_norm": Metric(' in MODULES["diagnostic"]


# --- the names the api had before it was split by role, for one release ----------------------

def test_an_old_api_name_resolves_with_a_warning_naming_its_new_place():
    from fedmech_flwr.api.strategy import WeightedFedAvg

    with pytest.warns(DeprecationWarning, match=r"^fedmech_flwr\.api\.WeightedFedAvg is deprecated and goes in the "
                                                r"next release: import it from fedmech_flwr\.api\.strategy$") as caught:
        from fedmech_flwr.api import WeightedFedAvg as old
    assert old is WeightedFedAvg and caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"^fedmech_flwr\.api\.a_norm is deprecated and goes in the next "
                                                r"release: it is no longer public"):
        assert api.a_norm is _builtin.a_norm
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        api.nothing  # noqa: B018


def test_the_old_registration_styles_still_register_with_a_warning(monkeypatch):
    """``api.register(kind, name)`` and ``api.register_module`` register as before, warned
    about: the one style left is ``REGISTRY.register(name, ConfigCls, ...)``."""
    from fedmech_flwr.api.model import MODELS
    from fedmech_flwr.api.strategy import OFFERED_NODES_ONLY, STRATEGIES, FedAvgConfig, WeightedFedAvg

    monkeypatch.setattr(STRATEGIES, "_entries", dict(STRATEGIES._entries))
    monkeypatch.setattr(MODELS, "_entries", dict(MODELS._entries))
    with pytest.warns(DeprecationWarning, match=r"^fedmech_flwr\.api\.register is deprecated and goes in the next "
                                                r"release: register it with its role's registry, e\.g\. "
                                                r"@STRATEGIES\.register\(name, ConfigCls\) from "
                                                r"fedmech_flwr\.api\.strategy$"):
        register = api.register

    @register("strategy", "api_registered", FedAvgConfig)
    def api_registered(params, ctx):
        return WeightedFedAvg(weighting=params.weighting, **OFFERED_NODES_ONLY)

    entry = STRATEGIES.get("api_registered")
    assert entry.factory is api_registered and entry.config_cls is FedAvgConfig and entry.module == __name__
    with pytest.raises(ConfigError, match="unknown plug-in kind 'strategies'; choose one of: dataset, partition"):
        register("strategies", "x")
    with pytest.warns(DeprecationWarning, match=r"^fedmech_flwr\.api\.register_module is deprecated"):
        register_module = api.register_module

    @register_module("api_mlp", head="1")
    def api_mlp(cfg, *, in_channels, num_classes, image_size):
        import torch.nn as nn
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))

    assert MODELS.get("api_mlp").module == __name__


# --- the built-in packages' names -----------------------------------------------------------

TRAPS = ("tests", "benchmarks", "examples", "scripts", "fedmech_flwr", "fedmech_flwr.foundation.registry")
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
    from fedmech_flwr.api.strategy import STRATEGIES

    plugins.load()  # idempotent: a second load registers nothing twice
    for name in (*BUILTIN_FOLDERS, "diagnostics.circuits", "diagnostics.usae"):
        package = importlib.import_module(f"fedmech_flwr.builtin.{name}")
        assert Path(package.__file__) == REPO.joinpath(*name.split("."), "__init__.py")
    fedavg = importlib.import_module("fedmech_flwr.builtin.strategies.fedavg")
    assert fedavg.STRATEGIES is STRATEGIES
    assert STRATEGIES.get("fedavg").module == "fedmech_flwr.builtin.strategies.fedavg"
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
    wrote them before) or the built-ins' private api is told once, by a log line that no
    warning filter hides; one that imports only the public api is told nothing."""
    import logging

    (tmp_path / "lab_internal.py").write_text("import fedmech_flwr.contracts.hooks\nfrom fedmech_flwr.contracts import strategy\n"
                                              "from fedmech_flwr.api import _builtin\n"
                                              "from fedmech_flwr.api.strategy import STRATEGIES\n")
    (tmp_path / "lab_public.py").write_text("from fedmech_flwr.api.strategy import STRATEGIES\nimport fedmech_flwr.api\n"
                                            "from fedmech_flwr.api import ConfigError, model\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fedmech_flwr.contracts.plugins"):
        for _ in range(2):
            plugins.import_plugin("lab_internal", "x.yaml: plugins[0]")
            plugins.import_plugin("lab_public", "x.yaml: plugins[1]")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["plug-in lab_internal imports fedmech_flwr.api._builtin, fedmech_flwr.contracts.hooks, fedmech_flwr.contracts.strategy: "
                    "internal modules, which change without notice; import what it needs from fedmech_flwr.api and "
                    "its role modules instead (fedmech_flwr.api.strategy, ...: their __all__ list every name a "
                    "plug-in may use)"]
    for name in ("lab_internal", "lab_public"):
        del sys.modules[name]  # imported here only: gone with its folder
