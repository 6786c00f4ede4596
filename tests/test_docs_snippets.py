"""What the README and the site show runs as shown: every fenced block of README.md and
docs/**/*.md is checked, page by page, in order.

- ``python``: executed, the blocks of one page in one namespace (as in a notebook), in a
  folder where the page's earlier commands ran; what they register is forgotten after the
  page. A block made only of ``--8<-- "PATH"`` lines shows a file of the repository
  (pymdownx.snippets): the file must exist and compile; its own test runs it.
- ``bash``: each command (continued lines joined, comments dropped), run from a folder
  that looks like the repository's root (its folders linked, nothing written into them):

  - ``fedmech ...`` / ``.venv/bin/fedmech ...`` is parsed by the real CLI parser, and the
    files it names (experiments, sweep files, run and sweep folders, ``--paper``,
    ``--node-data``) must exist. The cheap commands run for real, in process, and must exit
    0: validate, list, status, plot, report, export, new, misalignment-table, and sweep
    with ``--dry-run``; a long one runs as that check of the same file and overrides (run
    and deploy-local as validate, sweep with ``--dry-run``, ``run --resume`` and usae
    parsed only);
  - ``make TARGET``: the target exists; ``python -m MODULE``: the module exists (``pytest``:
    its paths); ``python SCRIPT``: the script exists (``scripts/write_node_data.py`` runs);
  - ``flwr run APP``: the app folder is a Flower app, every ``--run-config`` key is one it
    declares, its ``experiment`` validates and ``num-supernodes`` matches the clients;
    another ``flwr`` subcommand: ``flwr SUB --help`` works; ``tensorboard``: installed;
    ``export``, ``source``: taken as they are.

  Anything else fails: check it here, or mark the block.
- ``yaml`` / ``toml``: must parse; ``text``: output, shown only.

Placeholders stand for a small real sweep (``experiments/smoke_sweep.yaml``, seed 0, its
cells run in process on the synthetic dataset): ``SWEEP_DIR`` and ``~/fedmech-runs/NAME``
for the sweep folder, ``RUN_DIR``, ``RUN_A`` ... for its cells' run folders.

A block that cannot run on one machine (real devices, a cluster) carries its reason on the
line before it, ``<!-- not run here: REASON -->``; it is reported as skipped with that
reason. docs/tutorials/first_strategy.md is run whole by tests/test_tutorial.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import REPO, fenced_blocks, once_per_session

PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
RUN_ELSEWHERE = {"docs/tutorials/first_strategy.md": "run whole, at smoke size, by tests/test_tutorial.py"}
NOT_RUN = re.compile(r"^<!-- not run here: (.+?) -->$")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
LANGUAGES = {"bash", "python", "yaml", "toml", "text"}
LINKED = ("experiments", "scripts", "examples", "docs", "tests", "benchmarks", "clients", "strategies", "diagnostics",
          "results", "fedmech_flwr", "pyproject.toml", "Makefile", "mkdocs.yml")
"""What the working folder links from the repository, so commands read as from its root."""
CHEAP = {"validate", "list", "status", "plot", "report", "export", "new", "misalignment-table"}
"""fedmech commands that run for real (seconds on the fixture's folders)."""
RUN_SCRIPTS = {"scripts/write_node_data.py"}
PATH_ARGS = ("experiment", "sweep", "run_dir", "path", "paths", "resume", "paper", "node_data", "certs", "sources",
             "runs")
"""Namespace attributes of a parsed fedmech command that name inputs, which must exist."""


@dataclass
class Block:
    page: str
    language: str
    text: str
    line: int
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.language} block)"


def page_name(path: Path) -> str:
    return str(path.relative_to(REPO))


def blocks(path: Path) -> list[Block]:
    try:
        found = fenced_blocks(path.read_text())
    except ValueError as err:
        raise AssertionError(f"{page_name(path)}: {err}") from None
    return [Block(page_name(path), language, body, line, m.group(1) if (m := NOT_RUN.match(previous)) else None)
            for language, body, line, previous in found]


ALL = [b for page in PAGES for b in blocks(page)]


# --- the fixture: a small real sweep -------------------------------------------------------


class _InProcess:
    """``sweep.WarmSimulations`` running each cell in this process (no Flower or Ray
    launch): the cells end as a real sweep's, in seconds."""

    def __init__(self, num_cpus=None) -> None:
        pass

    def get(self, ray_address):
        return self

    def discard(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, run_config, num_clients, simulation, stream=None, verbose=False):
        from fedmech_flwr.app.inprocess import _grid
        from fedmech_flwr.app.experiment_run import run_experiment
        from fedmech_flwr.spec.experiment import load_experiment
        from fedmech_flwr.tools.local_flower import LaunchResult

        cfg = load_experiment(run_config["experiment"], json.loads(run_config["overrides"]))
        run_experiment(_grid(cfg, None), cfg, run_dir=run_config["run-dir"])
        return LaunchResult(None, "finished:completed")


def _make_sweep(folder: Path) -> None:
    from fedmech_flwr.tools import sweep
    from fedmech_flwr.tools.cli import main

    with mock.patch.object(sweep, "WarmSimulations", _InProcess), contextlib.redirect_stdout(io.StringIO()):
        assert main(["sweep", str(REPO / "experiments" / "smoke_sweep.yaml"), "--seeds", "0", "--out", str(folder)]) == 0


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """The 4 completed cells of experiments/smoke_sweep.yaml at seed 0 (IID and Dirichlet 0.5,
    FedAvg and FedProx, the misalignment diagnostic), read-only: each page gets a copy."""
    return once_per_session(tmp_path_factory, "docs-sweep", _make_sweep) / "smoke-sweep"


# --- checking one page ---------------------------------------------------------------------


class Page:
    """One page's blocks, checked in order in one working folder."""

    def __init__(self, path: Path, folder: Path, sweep: Path) -> None:
        self.name = page_name(path)
        self.folder = folder
        for entry in LINKED:
            (folder / entry).symlink_to(REPO / entry)
        shutil.copytree(sweep, folder / "fixture" / sweep.name)
        runs = folder / "fixture" / sweep.name / "runs"
        self.places = {
            "SWEEP_DIR": folder / "fixture" / sweep.name,
            "RUN_DIR": runs / "iid_fedavg_s0", "RUN_A": runs / "iid_fedavg_s0", "RUN_IID": runs / "iid_fedavg_s0",
            "RUN_B": runs / "dir0.5_fedavg_s0", "RUN_NONIID": runs / "dir0.5_fedavg_s0",
            "RUN_C": runs / "iid_fedprox_s0",
        }
        self.module = types.ModuleType("docs_page")  # a real module: dataclasses look their module up
        self.namespace = self.module.__dict__
        self.env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
        self.notes: list[str] = []
        self.flwr_help: dict[str, int] = {}

    def substitute(self, text: str) -> str:
        text = re.sub(r"~/fedmech-runs/[A-Za-z0-9._-]+", str(self.places["SWEEP_DIR"]), text)
        for word, path in self.places.items():
            text = re.sub(rf"\b{word}\b", str(path), text)
        return text

    def check(self, block: Block) -> None:
        assert block.language in LANGUAGES, (f"{block.where}: a block is bash, python, yaml, toml or text, got "
                                             f"{block.language or 'no language'!r}")
        if block.language == "python":
            self.python(block)
        elif block.language == "bash":
            self.bash(block)
        elif block.language == "yaml":
            try:
                yaml.safe_load(block.text)
            except yaml.YAMLError as err:
                raise AssertionError(f"{block.where} is not YAML: {err}") from None
        elif block.language == "toml":
            try:
                tomllib.loads(block.text)
            except tomllib.TOMLDecodeError as err:
                raise AssertionError(f"{block.where} is not TOML: {err}") from None

    # python

    def python(self, block: Block) -> None:
        lines = [line for line in block.text.splitlines() if line.strip()]
        shown = [m.group(1) for line in lines if (m := SNIPPET.match(line))]
        if shown:
            assert len(shown) == len(lines), f"{block.where}: mixes --8<-- lines with code"
            for path in shown:
                assert (REPO / path).is_file(), f"{block.where} shows {path}, which does not exist"
                compile((REPO / path).read_text(), path, "exec")
            return
        code = compile(self.substitute(block.text), f"{block.where}", "exec")
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(code, self.namespace)
        except Exception as err:
            raise AssertionError(f"{block.where} raised {type(err).__name__}: {err}\n{block.text}") from err

    # bash

    def bash(self, block: Block) -> None:
        text = re.sub(r"\\\n", " ", block.text)
        outs: set[str] = set()
        for raw in text.splitlines():
            line = self.substitute(raw).strip()
            if not line or line.startswith("#"):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError as err:
                raise AssertionError(f"{block.where}: cannot split {raw!r}: {err}") from None
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)  # VAR=value before the command
            if not words:
                continue
            where = f"{block.where}: `{raw.strip()}`"
            program = words[0]
            if program in ("fedmech", ".venv/bin/fedmech"):
                self.fedmech(words[1:], where, outs)
            elif program == "make":
                targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
                missing = [t for t in words[1:] if not t.startswith("-") and t not in targets]
                assert not missing, f"{where}: no make target {missing} (the Makefile has {sorted(targets)})"
            elif program in ("python", "python3", ".venv/bin/python"):
                self.python_command(words[1:], where)
            elif program == "flwr":
                self.flwr(words[1:], where)
            elif program == "tensorboard":
                assert shutil.which("tensorboard", path=self.env["PATH"]), f"{where}: tensorboard is not installed"
            elif program == "export":
                for word in words[1:]:
                    name, _, value = word.partition("=")
                    self.env[name] = value
            elif program == "source":
                assert (REPO / words[1]).is_file(), f"{where}: {words[1]} does not exist (after make setup)"
            else:
                raise AssertionError(f"{where}: no rule checks `{program}`; add one to tests/test_docs_snippets.py, "
                                     "or put <!-- not run here: REASON --> on the line before the block")

    def fedmech(self, argv: list[str], where: str, outs: set[str]) -> None:
        from fedmech_flwr.tools.cli import build_parser, main

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{where}: the CLI refuses it:\n{err.getvalue()}") from None
        for key in PATH_ARGS:
            values = getattr(args, key, None)
            for value in values if isinstance(values, list) else [values]:
                if value is None or "*" in str(value) or str(value).split("/")[0] in outs:
                    continue  # made by an earlier command of the block (its --out)
                path = Path(str(value).split("@")[0].split(":")[0])
                assert (self.folder / path).exists(), f"{where}: {value} does not exist"
        if getattr(args, "out", None):
            outs.add(str(args.out).split("/")[0])
        if getattr(args, "dir", None):
            outs.add(str(args.dir).split("/")[0])
        command = args.command
        if command in ("run", "deploy-local"):
            if getattr(args, "resume", None):
                return  # continues a killed run: parsed, its folder exists
            argv = ["validate", args.experiment, *[w for s in args.set for w in ("--set", s)]]
        elif command == "sweep":
            argv = argv if args.dry_run else [*argv, "--dry-run"]
        elif command not in CHEAP:
            return  # long (usae): parsed, its inputs exist
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        if code != 0 and "is not on this machine" in err.getvalue():
            self.notes.append(f"{where}: not checked, its dataset is not on this machine")
            return
        assert code == 0, f"{where}: `fedmech {' '.join(argv)}` exited {code}:\n{err.getvalue()[-3000:]}"

    def python_command(self, argv: list[str], where: str) -> None:
        import importlib.util

        if argv[:2] == ["-m", "pytest"]:
            for path in (a for a in argv[2:] if not a.startswith("-")):
                assert (self.folder / path).exists(), f"{where}: {path} does not exist"
        elif argv[0] == "-m":
            assert importlib.util.find_spec(argv[1]) is not None, f"{where}: no module {argv[1]}"
        else:
            assert (self.folder / argv[0]).is_file(), f"{where}: {argv[0]} does not exist"
            if argv[0] in RUN_SCRIPTS:
                proc = subprocess.run([sys.executable, *argv], cwd=self.folder, env=self.env, capture_output=True,
                                      text=True, timeout=300)
                assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stderr[-3000:]}"

    def flwr(self, argv: list[str], where: str) -> None:
        from fedmech_flwr.foundation.errors import ConfigError
        from fedmech_flwr.spec.experiment import load_experiment

        if argv[0] != "run":
            if argv[0] not in self.flwr_help:
                self.flwr_help[argv[0]] = subprocess.run(["flwr", argv[0], "--help"], env=self.env,
                                                         capture_output=True, timeout=120).returncode
            assert self.flwr_help[argv[0]] == 0, f"{where}: `flwr {argv[0]} --help` fails: no such command"
            return
        app = self.folder / argv[1]
        assert (app / "pyproject.toml").is_file(), f"{where}: {argv[1]} is not a Flower app (no pyproject.toml)"
        declared = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
        options = {w: argv[i + 1] for i, w in enumerate(argv[:-1]) if w in ("--run-config", "--federation-config")}
        run_config = dict(w.split("=", 1) for w in shlex.split(options.get("--run-config", "")))
        unknown = sorted(set(run_config) - set(declared))
        assert not unknown, f"{where}: run-config keys {unknown} are not declared in {argv[1]}/pyproject.toml"
        nodes = dict(w.split("=", 1) for w in shlex.split(options.get("--federation-config", "")))
        if "experiment" in run_config:
            try:
                clients = load_experiment(app / run_config["experiment"], []).federation.num_clients
            except ConfigError as err:
                if "is not on this machine" not in str(err):
                    raise AssertionError(f"{where}: its experiment is invalid: {err}") from None
                self.notes.append(f"{where}: not checked, its dataset is not on this machine")
                return
        else:
            clients = int(run_config.get("num-partitions", declared.get("num-partitions", 0)))
        if "num-supernodes" in nodes:
            assert int(nodes["num-supernodes"]) == clients, (f"{where}: num-supernodes={nodes['num-supernodes']} but "
                                                             f"the run has {clients} clients")


@pytest.mark.parametrize("path", [p for p in PAGES if page_name(p) not in RUN_ELSEWHERE], ids=page_name)
def test_the_page_runs_as_shown(path, sweep_dir, tmp_path, monkeypatch, plugin_site):
    (tmp_path / "work").mkdir()
    page = Page(path, tmp_path / "work", sweep_dir)
    monkeypatch.chdir(page.folder)
    monkeypatch.setitem(sys.modules, page.module.__name__, page.module)
    for block in blocks(path):
        if block.skip is None:
            page.check(block)
    for note in page.notes:
        warnings.warn(note, stacklevel=1)


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: f"{b.page}:{b.line}")
def test_a_block_marked_not_run_here_is_reported_skipped(block):
    assert block.text.strip(), f"{block.where} is empty"
    pytest.skip(f"{block.where}: not run here: {block.skip}")


def test_pages_run_elsewhere_exist():
    for name, reason in RUN_ELSEWHERE.items():
        assert (REPO / name).is_file(), f"{name} ({reason}) is gone"


def test_the_readme_keeps_the_two_commands_first():
    first = blocks(REPO / "README.md")[0]
    commands = [line.split("#")[0].strip() for line in first.text.splitlines()]
    assert commands == ["make demo", "make test"], "the README's first block is the two commands (.ci/run)"
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert len((REPO / "README.md").read_text().splitlines()) <= 220, "the README stays short: the rest is the site"


@pytest.mark.parametrize(("text", "message"), [
    ("```bash\nrm -rf /tmp/x\n```\n", "no rule checks `rm`"),
    ("```bash\n.venv/bin/fedmech validate experiments/nope.yaml\n```\n", "experiments/nope.yaml does not exist"),
    ("```bash\nfedmech run experiments/smoke.yaml --set federation.num_rounds=0\n```\n", "exited 2"),
    ("```bash\nfedmech nwe strategy x\n```\n", "the CLI refuses it"),
    ("```bash\nmake docz\n```\n", "no make target ['docz']"),
    ("```python\nimport pandas\npandas.read_csv('missing.csv')\n```\n", "raised FileNotFoundError"),
    ("```sh\nls\n```\n", "got 'sh'"),
    ("```yaml\na: [1\n```\n", "is not YAML"),
])
def test_a_wrong_block_fails_naming_its_line(text, message, sweep_dir, tmp_path, monkeypatch, plugin_site):
    path = tmp_path / "page.md"
    path.write_text(text)
    (tmp_path / "work").mkdir()
    with mock.patch(f"{__name__}.page_name", lambda p: "page.md"):
        page = Page(path, tmp_path / "work", sweep_dir)
        monkeypatch.chdir(page.folder)
        monkeypatch.setitem(sys.modules, page.module.__name__, page.module)
        with pytest.raises(AssertionError, match=re.escape(message)):
            for block in blocks(path):
                page.check(block)
